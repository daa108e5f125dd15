"""The transport endpoint one rank's KV manager opens: which backend (tcp or verbs), which RDMA
device (Lynx's flag, else SGLang's own `--disaggregation-ib-device` resolved per GPU), TLS for tcp,
and the start-up log lines that tell an operator what was chosen (including GPUDirect RDMA's
availability on the opened device).

Called once per process by `backend.manager.LynxKVManager.init_engine` (SGLang's engine hook).
"""

from __future__ import annotations

import logging

from lynx_transport import Endpoint, PriorityPolicy, gpu_direct

from ..config import LynxConfig
from ..errors import LynxConfigError
from ..upstream.sglang_names import ib_devices_for_gpu

logger = logging.getLogger(__name__)


def rdma_device(lynx_device: str | None, sglang_devices: str | None, gpu_id: int) -> str | None:
    """This rank's RDMA device: `--lynx-ib-device` if given, else SGLang's
    `--disaggregation-ib-device` resolved for this GPU the way SGLang's Mooncake backend does it (a
    list "mlx5_0,mlx5_1", a per-GPU JSON map '{"0": "mlx5_0"}' or a JSON file of one); where
    that leaves several devices, the GPU's own by index (the transport drives one NIC per rank)."""
    if lynx_device:
        return lynx_device
    if not sglang_devices:
        return None
    try:
        resolved = ib_devices_for_gpu(sglang_devices, gpu_id)
    except ValueError as exc:
        raise LynxConfigError(f"--disaggregation-ib-device: {exc}") from None
    devices = [d.strip() for d in resolved.split(",") if d.strip()]
    return devices[gpu_id % len(devices)] if devices else None


def open_endpoint(lynx: LynxConfig, host: str, name: str, sglang_ib_devices: str | None,
                  gpu_id: int) -> Endpoint:
    """The rank's endpoint on `host`, with the backend options the config asks for; logs them."""
    if lynx.transport == "verbs":
        device = rdma_device(lynx.ib_device, sglang_ib_devices, gpu_id)
        options = lynx.verbs_options(device)
        logger.info("lynx: verbs transport on RDMA device %s (GID index %s; Anchor SL %d TC "
                    "%d, Residual SL %d TC %d)", device or "(the first one)",
                    "auto" if options["gid_index"] is None else options["gid_index"],
                    options["anchor_sl"], options["anchor_tc"], options["residual_sl"],
                    options["residual_tc"])
    else:
        tls = lynx.tls_config()
        options = {"tls": tls} if tls else None
        logger.info("lynx: tcp transport, data connections %s, link order %s",
                    f"in TLS 1.3 (certificate {tls.cert_file}, CA {tls.ca_file})" if tls
                    else "in clear (no TLS: --lynx-tls-cert/-key/-ca to encrypt them)",
                    "on" if lynx.link_order else "off")
    # The order across the requests that share a link (lynx_transport.link_order) is the
    # sender's: the prefill's; the verbs backend keeps plain strict priority.
    endpoint = Endpoint(backend=lynx.transport, host=host, secret=lynx.load_secret(),
                        allow_insecure=lynx.insecure, backend_options=options, name=name,
                        policy=PriorityPolicy(link_order=lynx.link_order))
    if lynx.transport == "verbs":
        # The device the backend opened (ibv_get_device_list's first when none was named), not
        # a guess made before it picked one.
        opened = endpoint.backend.local_info()["device"]
        logger.info("lynx: %s", gpu_direct.detect(opened).summary())
    return endpoint
