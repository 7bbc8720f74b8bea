// Command etcd is the upstream etcd server (the same entry point as etcd's own main package),
// built at the version k8s.io/kubernetes pins so the API server talks to the etcd it is tested
// with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
