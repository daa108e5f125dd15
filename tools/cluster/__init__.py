"""Local SGLang clusters for every tool and the end-to-end tests: the launcher (`local.Cluster`,
`lynx-sglang up`), what a cluster is (`spec`), its process trees (`process_tree`), shaped links
(`netns`, over the packaged `netlab.sh`) and TLS certificates (`tls_certs`, `lynx-sglang tls-certs`)."""
