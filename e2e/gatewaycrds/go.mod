// The Gateway API's and its Inference Extension's CRDs, pinned: build.sh copies the ones the
// tests install from these modules (no Go code here; the modules are only downloaded).
module fleetpilot.dev/e2e/gatewaycrds

go 1.26.0

require (
	sigs.k8s.io/gateway-api v1.6.3
	sigs.k8s.io/gateway-api-inference-extension v1.6.2
)
