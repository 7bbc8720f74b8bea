// Command processnode is a node agent for fleetpilot's e2e harness: a virtual-kubelet provider
// that runs each pod's containers as local processes on this machine.
//
// It registers one or more Nodes against a kubeconfig (node status, leases and the pod
// controller come from github.com/virtual-kubelet/virtual-kubelet's node packages) and, for
// every pod the scheduler binds to one of them:
//
//   - maps the container image to a local program through an explicit table (-images, a JSON
//     file the harness writes); any other image is refused with an Event naming it;
//   - gives the pod a network namespace of its own with a veth pair: the pod side carries the
//     pod IP (a /32 from 10.244.0.0/16, default route through the host by proxy ARP), the host
//     side a /32 host route to it. Processes bind 0.0.0.0:8000 as they would in a cluster,
//     pods reach each other and the host, and EndpointSlices hold real, reachable addresses
//     (the API server refuses loopback there). veth was chosen over /32 addresses on `lo`
//     because on `lo` every pod shares one port space: two replicas binding 0.0.0.0:8000 clash;
//   - makes the API server reachable from pods as a cluster does: the test API server listens
//     on 127.0.0.1 only, so the agent puts the `kubernetes` Service's ClusterIP on the host's
//     `lo` and forwards TCP from it to the API server, and sets KUBERNETES_SERVICE_HOST/PORT
//     to that ClusterIP (the serving certificate already names it);
//   - gives each container process a private mount namespace (`ip netns exec` makes one) in
//     which volumes (emptyDir, ConfigMap, Secret, projected service-account tokens, hostPath,
//     PVCs bound to hostPath PVs) are bind-mounted at their mountPath, so /etc/fleetpilot is
//     visible to that pod only;
//   - runs init containers in order, then the containers, with probes, restart back-off and
//     termination grace, reporting status truthfully; serves logs on the kubelet port.
//
// SIGTERM/SIGINT stops every pod (grace, then SIGKILL of the process group and of anything
// left in the pod's network namespace), removes namespaces, links, addresses and directories,
// and exits.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/virtual-kubelet/virtual-kubelet/log"
	vkslog "github.com/virtual-kubelet/virtual-kubelet/log/slog"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"net/http"
)

type options struct {
	kubeconfig  string
	nodes       string
	cpu         string
	memory      string
	pods        string
	gpus        int
	gpuProduct  string
	images      string
	stateDir    string
	portBase    int
	backoffBase time.Duration
	backoffMax  time.Duration
	taints      string
	ports       string
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == helperCommand {
		os.Exit(runHelper(os.Args[2:]))
	}
	var o options
	flag.StringVar(&o.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the cluster to join")
	flag.StringVar(&o.nodes, "nodes", "process-node-0", "comma-separated names of the nodes to register")
	flag.StringVar(&o.cpu, "cpu", "8", "allocatable cpu of each node")
	flag.StringVar(&o.memory, "memory", "32Gi", "allocatable memory of each node")
	flag.StringVar(&o.pods, "pods", "110", "allocatable pods of each node")
	flag.IntVar(&o.gpus, "gpus", 0, "nvidia.com/gpu count of each node (0: none)")
	flag.StringVar(&o.gpuProduct, "gpu-product", "", "nvidia.com/gpu.product label (with -gpus)")
	flag.StringVar(&o.images, "images", "", "JSON image table: image patterns -> local programs")
	flag.StringVar(&o.stateDir, "state-dir", "/tmp/processnode", "pod volumes and logs live here")
	flag.IntVar(&o.portBase, "port-base", 10250, "kubelet port of the first node; node i listens on port-base+i")
	flag.DurationVar(&o.backoffBase, "backoff-base", 10*time.Second, "first restart back-off (kubelet: 10s)")
	flag.DurationVar(&o.backoffMax, "backoff-max", 300*time.Second, "longest restart back-off (kubelet: 5m)")
	flag.StringVar(&o.taints, "taints", "", "comma-separated key=value:Effect taints on every node, so only pods that tolerate them land here")
	flag.StringVar(&o.ports, "ports", "", "comma-separated kubelet ports, one per node (instead of -port-base)")
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "processnode:", err)
		os.Exit(1)
	}
}

func run(o options) error {
	// virtual-kubelet logs nothing by default; its warnings (status updates that failed, pods
	// it could not sync) and ours go to stderr, which the harness keeps as the agent's log.
	log.L = vkslog.FromSlog(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()

	table, err := loadImageTable(o.images)
	if err != nil {
		return err
	}
	// nodeutil.NewNode builds a client from $KUBECONFIG before taking ours, and warns without it.
	_ = os.Setenv("KUBECONFIG", o.kubeconfig)
	restCfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	stateDir, err := filepath.Abs(o.stateDir)
	if err != nil {
		return err
	}
	net, err := newNetwork(ctx, client, restCfg.Host)
	if err != nil {
		return err
	}
	agent := &agent{
		client: client, images: table, self: self, stateDir: stateDir, net: net,
		backoffBase: o.backoffBase, backoffMax: o.backoffMax, dirs: newDirTracker(),
	}
	defer agent.dirs.removeAll()
	defer net.close()

	eb := record.NewBroadcaster()
	eb.StartRecordingToSink(&corev1client.EventSinkImpl{Interface: client.CoreV1().Events(v1.NamespaceAll)})
	defer eb.Shutdown()

	cert, err := selfSignedCert()
	if err != nil {
		return err
	}
	var providers []*provider
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	runCtx, stopNodes := context.WithCancel(context.Background())
	defer stopNodes()
	for i, name := range strings.Split(o.nodes, ",") {
		name = strings.TrimSpace(name)
		recorder := eb.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: name})
		var prov *provider
		mux := http.NewServeMux()
		port := o.portBase + i
		if ports := strings.Split(o.ports, ","); o.ports != "" && i < len(ports) {
			if _, err := fmt.Sscan(ports[i], &port); err != nil {
				return fmt.Errorf("-ports: %w", err)
			}
		}
		n, err := nodeutil.NewNode(name,
			func(cfg nodeutil.ProviderConfig) (nodeutil.Provider, node.NodeProvider, error) {
				prov = newProvider(agent, name, cfg, recorder)
				return prov, nil, nil
			},
			nodeutil.WithClient(client),
			nodeutil.AttachProviderRoutes(mux),
			func(cfg *nodeutil.NodeConfig) error {
				cfg.EventRecorder = recorder
				cfg.SkipDownwardAPIResolution = true // resolved here, once the pod IP exists
				cfg.NumWorkers = 8
				cfg.HTTPListenAddr = fmt.Sprintf("127.0.0.1:%d", port)
				cfg.Handler = nodeutil.WithAuth(nodeutil.NoAuth(), mux)
				cfg.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}}
				describeNode(&cfg.NodeSpec, o, port)
				return nil
			},
		)
		if err != nil {
			return fmt.Errorf("node %s: %w", name, err)
		}
		providers = append(providers, prov)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := n.Run(runCtx); err != nil && runCtx.Err() == nil {
				errs <- fmt.Errorf("node %s: %w", name, err)
			}
		}()
		if err := n.WaitReady(ctx, time.Minute); err != nil {
			return fmt.Errorf("node %s not ready: %w", name, err)
		}
		log.G(ctx).Infof("node %s ready, kubelet port %d", name, port)
	}
	fmt.Println("processnode: ready") // the harness waits for this line

	select {
	case <-ctx.Done():
	case err = <-errs:
	}
	// Stop the pods before the node controllers, so their final status reaches the API server.
	agent.stoppingMu.Lock()
	agent.stopping = true
	agent.stoppingMu.Unlock()
	var stop sync.WaitGroup
	for _, p := range providers {
		stop.Add(1)
		go func() { defer stop.Done(); p.stopAll() }()
	}
	stop.Wait()
	stopNodes()
	wg.Wait()
	return err
}

// describeNode fills in what a kubelet reports about its machine: capacity, labels, the
// address and port the API server dials for logs, and conditions other than Ready.
func describeNode(n *v1.Node, o options, port int) {
	res := v1.ResourceList{
		v1.ResourceCPU:    resource.MustParse(o.cpu),
		v1.ResourceMemory: resource.MustParse(o.memory),
		v1.ResourcePods:   resource.MustParse(o.pods),
	}
	n.Labels["kubernetes.io/os"] = "linux"
	n.Labels["kubernetes.io/arch"] = "amd64"
	n.Labels["fleetpilot.dev/process-node"] = "true"
	if o.gpus > 0 {
		res["nvidia.com/gpu"] = *resource.NewQuantity(int64(o.gpus), resource.DecimalSI)
		n.Labels["nvidia.com/gpu.count"] = fmt.Sprint(o.gpus)
		n.Labels["nvidia.com/gpu.present"] = "true"
		if o.gpuProduct != "" {
			n.Labels["nvidia.com/gpu.product"] = o.gpuProduct
		}
	}
	for _, t := range strings.Split(o.taints, ",") {
		if t = strings.TrimSpace(t); t == "" {
			continue
		}
		kv, effect, _ := strings.Cut(t, ":")
		k, v, _ := strings.Cut(kv, "=")
		n.Spec.Taints = append(n.Spec.Taints, v1.Taint{Key: k, Value: v, Effect: v1.TaintEffect(effect)})
	}
	n.Status.Capacity = res
	n.Status.Allocatable = res.DeepCopy()
	now := metav1.Now()
	for i := range n.Status.Conditions {
		c := &n.Status.Conditions[i]
		if c.Type == v1.NodeReady {
			continue
		}
		c.Status = v1.ConditionFalse
		c.Reason = "KubeletHasNo" + string(c.Type)
		c.LastHeartbeatTime = now
		c.LastTransitionTime = now
	}
	n.Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "127.0.0.1"}}
	n.Status.DaemonEndpoints.KubeletEndpoint.Port = int32(port)
	n.Status.NodeInfo = v1.NodeSystemInfo{
		Architecture: "amd64", OperatingSystem: "linux", OSImage: "fleetpilot process node",
		KubeletVersion: "v1.37.2-processnode", ContainerRuntimeVersion: "process://0",
		MachineID: n.Name,
	}
}

// selfSignedCert serves the kubelet port. The test API server dials kubelets without a
// kubelet CA (--kubelet-certificate-authority unset), so it does not verify this one.
func selfSignedCert() (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: "processnode"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * 365 * time.Hour),
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, &tmpl, &tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// imageRule maps images matching Pattern ("exact" or "prefix*") to a local program.
type imageRule struct {
	Pattern    string            `json:"pattern"`
	Path       []string          `json:"path"`       // prepended to PATH, e.g. the venv's bin
	Entrypoint []string          `json:"entrypoint"` // the image's ENTRYPOINT
	Cmd        []string          `json:"cmd"`        // the image's CMD
	WorkingDir string            `json:"workingDir"` // the image's WORKDIR
	Env        map[string]string `json:"env"`        // the image's ENV
}

type imageTable struct {
	Images []imageRule `json:"images"`
}

func loadImageTable(path string) (*imageTable, error) {
	t := &imageTable{}
	if path == "" {
		return t, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("image table: %w", err)
	}
	if err := json.Unmarshal(data, t); err != nil {
		return nil, fmt.Errorf("image table %s: %w", path, err)
	}
	return t, nil
}

func (t *imageTable) lookup(image string) *imageRule {
	for i := range t.Images {
		p := t.Images[i].Pattern
		if p == image || (strings.HasSuffix(p, "*") && strings.HasPrefix(image, strings.TrimSuffix(p, "*"))) {
			return &t.Images[i]
		}
	}
	return nil
}
