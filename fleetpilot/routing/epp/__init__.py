"""The router as a Gateway API Inference Extension endpoint picker (EPP): Envoy's
external-processing gRPC protocol (``protocol``) served over the router's own decision path
(``server``), on the port ``eppPort`` of the router's config."""
