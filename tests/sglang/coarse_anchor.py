"""Server flags of the speculation end-to-end clusters (test_pd_lynx_spec, test_pd_lynx_sampling):
a deliberately coarse Anchor (2 bits, nothing protected, no rotation), so Anchor-precision KV often
disagrees with the exact KV and verification has rollbacks to do; target exact, so every answer
must still equal a single full-precision server's. `--lynx-spec-policy always`: these clusters test
speculation itself, so it must happen whatever the link and CPU make it worth."""

COARSE_ANCHOR_SPEC_ARGS = (
    "--lynx-target", "exact", "--lynx-speculate", "--lynx-spec-policy", "always",
    "--lynx-anchor-bits", "2", "--no-lynx-rotate",
    "--lynx-sink-tokens", "0", "--lynx-recent-tokens", "0",
)
