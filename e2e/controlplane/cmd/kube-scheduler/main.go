// Command kube-scheduler is upstream's kube-scheduler (k8s.io/kubernetes/cmd/kube-scheduler),
// rebuilt from Go modules with the machine's toolchain so the e2e tests run against a real
// control plane. The imports mirror upstream's main package.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register" // for JSON log format registration
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version" // for version metric registration
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	command := app.NewSchedulerCommand()
	code := cli.Run(command)
	os.Exit(code)
}
