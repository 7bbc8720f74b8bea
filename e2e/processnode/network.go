package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"

	"github.com/virtual-kubelet/virtual-kubelet/log"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

const (
	netnsPrefix = "fpn-" // every namespace this agent makes; leftovers are swept at start
	vethPrefix  = "fpv"
	// The pods' default gateway: never assigned anywhere, the host's side of every veth
	// answers ARP for it (proxy_arp), as Calico does.
	gatewayIP   = "169.254.1.1"
	ipForward   = "/proc/sys/net/ipv4/ip_forward"
	podNetFirst = 1 // 10.244.0.x is left alone
)

// network owns the host side: the pod address pool, ip_forward, and the forwarder that makes
// the API server reachable at the `kubernetes` Service's ClusterIP.
type network struct {
	mu          sync.Mutex
	used        map[string]bool
	apiHost     string // the ClusterIP the pods dial
	apiPort     string
	listener    net.Listener
	forwardWas  string
	addedLoAddr bool
}

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func newNetwork(ctx context.Context, client kubernetes.Interface, server string) (*network, error) {
	n := &network{used: map[string]bool{}}
	sweepNamespaces(ctx)
	was, err := os.ReadFile(ipForward)
	if err != nil {
		return nil, err
	}
	n.forwardWas = strings.TrimSpace(string(was))
	// Pod-to-pod traffic crosses the host between two veths.
	if err := os.WriteFile(ipForward, []byte("1"), 0o644); err != nil {
		return nil, err
	}
	svc, err := client.CoreV1().Services("default").Get(ctx, "kubernetes", metav1.GetOptions{})
	if err != nil {
		n.close()
		return nil, fmt.Errorf("the kubernetes Service: %w", err)
	}
	u, err := url.Parse(server)
	if err != nil {
		n.close()
		return nil, err
	}
	target := u.Host
	n.apiHost = svc.Spec.ClusterIP
	n.apiPort = fmt.Sprint(svc.Spec.Ports[0].Port)
	// "File exists": an agent that was SIGKILLed left it; this one removes it at exit.
	if err := ipCmd("addr", "add", n.apiHost+"/32", "dev", "lo"); err != nil && !strings.Contains(err.Error(), "File exists") {
		n.close()
		return nil, err
	}
	n.addedLoAddr = true
	n.listener, err = net.Listen("tcp", net.JoinHostPort(n.apiHost, n.apiPort))
	if err != nil {
		n.close()
		// One agent per machine: namespaces, the address pool and this port are its own.
		return nil, fmt.Errorf("API server forwarder (is another process node agent running here?): %w", err)
	}
	go n.forward(ctx, target)
	return n, nil
}

func (n *network) forward(ctx context.Context, target string) {
	for {
		c, err := n.listener.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			up, err := net.Dial("tcp", target)
			if err != nil {
				log.G(ctx).WithError(err).Warn("API server forwarder")
				return
			}
			defer up.Close()
			done := make(chan struct{}, 2)
			go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
			go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
			<-done
		}()
	}
}

func (n *network) close() {
	sweepNamespaces(context.Background()) // a pod that was still starting at shutdown
	if n.listener != nil {
		n.listener.Close()
	}
	if n.addedLoAddr {
		_ = ipCmd("addr", "del", n.apiHost+"/32", "dev", "lo")
	}
	if n.forwardWas != "" {
		_ = os.WriteFile(ipForward, []byte(n.forwardWas), 0o644)
	}
}

// allocate returns a free pod IP from 10.244.1.0 - 10.244.254.254.
func (n *network) allocate() (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for i := podNetFirst * 256; i < 255*256; i++ {
		if i%256 == 0 || i%256 == 255 {
			continue
		}
		ip := fmt.Sprintf("10.244.%d.%d", i/256, i%256)
		if !n.used[ip] {
			n.used[ip] = true
			return ip, nil
		}
	}
	return "", fmt.Errorf("pod address pool exhausted")
}

func (n *network) release(ip string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.used, ip)
}

// podNames derives the namespace and host link names from the pod IP, unique while it is held.
func podNames(ip string) (netns, hostLink string) {
	parts := strings.Split(ip, ".")
	suffix := parts[2] + "-" + parts[3]
	return netnsPrefix + suffix, vethPrefix + parts[2] + "x" + parts[3]
}

// setupPod makes the pod's network namespace: a veth pair, eth0 (the pod IP, /32) inside, a
// host route to the pod IP on the host side, a default route through the gateway outside.
func setupPod(ip string) (string, error) {
	ns, host := podNames(ip)
	steps := [][]string{
		{"netns", "add", ns},
		{"link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns},
		{"link", "set", host, "up"},
		{"route", "add", ip + "/32", "dev", host, "scope", "link"},
		{"-n", ns, "link", "set", "lo", "up"},
		{"-n", ns, "addr", "add", ip + "/32", "dev", "eth0"},
		{"-n", ns, "link", "set", "eth0", "up"},
		{"-n", ns, "route", "add", gatewayIP, "dev", "eth0", "scope", "link"},
		{"-n", ns, "route", "add", "default", "via", gatewayIP, "dev", "eth0"},
	}
	for i, s := range steps {
		if err := ipCmd(s...); err != nil {
			teardownPod(ip)
			return "", err
		}
		if i == 2 {
			if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+host+"/proxy_arp", []byte("1"), 0o644); err != nil {
				teardownPod(ip)
				return "", err
			}
		}
	}
	return ns, nil
}

// teardownPod kills whatever still runs in the pod's namespace and deletes it; deleting the
// namespace deletes the veth pair, and with the host side the host route.
func teardownPod(ip string) {
	ns, host := podNames(ip)
	killNamespace(ns)
	_ = ipCmd("link", "del", host)
	_ = ipCmd("netns", "del", ns)
}

// killNamespace SIGKILLs every process in network namespace ns: the sweep that catches what
// left the pod's process group (a daemonizing child, say).
func killNamespace(ns string) {
	for range 10 {
		out, err := exec.Command("ip", "netns", "pids", ns).Output()
		pids := strings.Fields(string(out))
		if err != nil || len(pids) == 0 {
			return
		}
		for _, p := range pids {
			var pid int
			if _, err := fmt.Sscan(p, &pid); err == nil && pid > 1 {
				_ = killPid(pid)
			}
		}
	}
}

// sweepNamespaces removes namespaces a killed agent left behind.
func sweepNamespaces(ctx context.Context) {
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		return
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && strings.HasPrefix(f[0], netnsPrefix) {
			log.G(ctx).Warnf("removing leftover network namespace %s", f[0])
			killNamespace(f[0])
			_ = ipCmd("netns", "del", f[0])
		}
	}
}
