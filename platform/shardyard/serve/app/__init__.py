"""The Serve application: the deployment that puts the wings together, the ingress settings
(HAProxy, its loopback launcher), the port holder and the `shardyard serve` command."""
