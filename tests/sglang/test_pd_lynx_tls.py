"""End to end through real SGLang with the tcp transport's data connections in TLS
(`lynx-sglang up --tls`: a CA and a node certificate made for the cluster, passed to both servers
as --lynx-tls-cert/-key/-ca; over the 1 Gbit/s shaped link between two network namespaces when run
as root, so the prefill dials the decode's namespace address and checks it against the
certificate). Greedy outputs must be token-identical to a single server's, speculation included.
"""

from __future__ import annotations

import pytest

from lynx_tools.client import generate
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec
from lynx_tools.measure import transfer_lines

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def tls_cluster(sglang_model, start_cluster, pd_link):
    return start_cluster(ClusterSpec(sglang_model, ClusterMode.PD, "lynx", link=pd_link, tls=True,
                                     server_args=("--lynx-target", "exact")))


def test_lynx_over_tls_matches_single_server(tls_cluster, reference_outputs, prompts,
                                             max_new_tokens):
    for prompt in prompts:
        got = generate(tls_cluster.url, text=prompt, max_new_tokens=max_new_tokens)
        assert got.output_ids == reference_outputs[prompt], prompt[:60]
    for role in ("prefill", "decode"):
        log = tls_cluster.log_path(role).read_text(errors="replace")
        assert "data connections in TLS 1.3" in log, role
    decode_log = tls_cluster.log_path("decode").read_text(errors="replace")
    records = transfer_lines(decode_log)
    assert len(records) >= len(prompts)
    assert "transport session from prefill rank" in decode_log
