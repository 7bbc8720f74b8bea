package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/log"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/record"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
)

// agent is what every node of this process shares: one address pool, one image table.
type agent struct {
	client kubernetes.Interface
	images *imageTable
	// stopping: the node is shutting down; pods the scheduler still binds here are not
	// started (their predecessors' Failed status makes controllers create replacements).
	stoppingMu  sync.Mutex
	stopping    bool
	self        string
	stateDir    string
	net         *network
	backoffBase time.Duration
	backoffMax  time.Duration
	dirs        *dirTracker
}

// provider is one node's pod lifecycle handler.
type provider struct {
	a        *agent
	nodeName string
	cfg      nodeutil.ProviderConfig
	rec      record.EventRecorder

	mu     sync.Mutex
	pods   map[string]*podRun
	notify func(*v1.Pod)
}

func newProvider(a *agent, name string, cfg nodeutil.ProviderConfig, rec record.EventRecorder) *provider {
	return &provider{a: a, nodeName: name, cfg: cfg, rec: rec, pods: map[string]*podRun{}, notify: func(*v1.Pod) {}}
}

func key(ns, name string) string { return ns + "/" + name }

func (p *provider) configMap(ns, name string) (*v1.ConfigMap, error) {
	return p.cfg.ConfigMaps.ConfigMaps(ns).Get(name)
}

func (p *provider) secret(ns, name string) (*v1.Secret, error) {
	return p.cfg.Secrets.Secrets(ns).Get(name)
}

// NotifyPods is how status reaches the API server: every state change calls it.
func (p *provider) NotifyPods(_ context.Context, f func(*v1.Pod)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notify = f
}

func (p *provider) CreatePod(ctx context.Context, pod *v1.Pod) error {
	p.a.stoppingMu.Lock()
	stopping := p.a.stopping
	p.a.stoppingMu.Unlock()
	if stopping {
		return fmt.Errorf("node is shutting down")
	}
	p.mu.Lock()
	if _, ok := p.pods[key(pod.Namespace, pod.Name)]; ok {
		p.mu.Unlock()
		return nil
	}
	r := newPodRun(p, pod)
	p.pods[key(pod.Namespace, pod.Name)] = r
	p.mu.Unlock()
	go r.run()
	return nil
}

// UpdatePod: a kubelet acts on few spec updates (image changes restart a container); this
// node keeps running what it started, and takes the new deletion fields on delete.
func (p *provider) UpdatePod(ctx context.Context, pod *v1.Pod) error {
	r, err := p.get(pod.Namespace, pod.Name)
	if err != nil || r.pod.UID == pod.UID {
		return err
	}
	// A new pod of the same name (a StatefulSet's) while the old one still stops: start it
	// once the old one is gone.
	go func() {
		r.stop(time.Duration(grace(r.pod)) * time.Second)
		p.mu.Lock()
		if p.pods[key(pod.Namespace, pod.Name)] == r {
			delete(p.pods, key(pod.Namespace, pod.Name))
		}
		p.mu.Unlock()
		_ = p.CreatePod(context.Background(), pod)
	}()
	return nil
}

func grace(pod *v1.Pod) int64 {
	if pod.DeletionGracePeriodSeconds != nil {
		return *pod.DeletionGracePeriodSeconds
	}
	if pod.Spec.TerminationGracePeriodSeconds != nil {
		return *pod.Spec.TerminationGracePeriodSeconds
	}
	return 30
}

func (p *provider) DeletePod(ctx context.Context, pod *v1.Pod) error {
	p.mu.Lock()
	r, ok := p.pods[key(pod.Namespace, pod.Name)]
	p.mu.Unlock()
	if !ok {
		return errdefs.NotFoundf("pod %s/%s is not on this node", pod.Namespace, pod.Name)
	}
	grace := grace(pod)
	r.mu.Lock()
	r.pod.DeletionTimestamp = pod.DeletionTimestamp
	r.pod.DeletionGracePeriodSeconds = pod.DeletionGracePeriodSeconds
	r.mu.Unlock()
	go func() {
		r.stop(time.Duration(grace) * time.Second)
		p.mu.Lock()
		if p.pods[key(pod.Namespace, pod.Name)] == r {
			delete(p.pods, key(pod.Namespace, pod.Name))
		}
		p.mu.Unlock()
		if pod.DeletionTimestamp != nil {
			p.finishDeletion(pod)
		}
	}()
	return nil
}

// finishDeletion removes the pod object once its containers are gone, as the kubelet's
// status manager does (grace 0, for this pod's UID only). virtual-kubelet alone would
// wait out the whole grace period even when the processes exited at SIGTERM.
func (p *provider) finishDeletion(pod *v1.Pod) {
	zero := int64(0)
	uid := pod.UID
	opts := metav1.DeleteOptions{GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &uid}}
	err := p.a.client.CoreV1().Pods(pod.Namespace).Delete(context.Background(), pod.Name, opts)
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		log.G(context.Background()).WithError(err).Warnf("pod %s/%s: final delete", pod.Namespace, pod.Name)
	}
}

// stopAll stops every pod, as at node shutdown, each with its own grace period.
func (p *provider) stopAll() {
	p.mu.Lock()
	runs := make([]*podRun, 0, len(p.pods))
	for _, r := range p.pods {
		runs = append(runs, r)
	}
	p.mu.Unlock()
	var wg sync.WaitGroup
	for _, r := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// As the kubelet's graceful node shutdown reports it: the pod ends Failed, and
			// its controller replaces it.
			r.mu.Lock()
			r.reason, r.message = "Terminated", "Pod was terminated in response to imminent node shutdown."
			r.mu.Unlock()
			r.stop(time.Duration(grace(r.pod)) * time.Second)
			p.writeFinalStatus(r)
		}()
	}
	wg.Wait()
}

// writeFinalStatus writes the pod's last status itself: virtual-kubelet's status queue stops
// with the node, before it would get to it.
func (p *provider) writeFinalStatus(r *podRun) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pods := p.a.client.CoreV1().Pods(r.pod.Namespace)
	for range 3 {
		current, err := pods.Get(ctx, r.pod.Name, metav1.GetOptions{})
		if err != nil || current.UID != r.pod.UID {
			return
		}
		current.Status = r.snapshot().Status
		if _, err = pods.UpdateStatus(ctx, current, metav1.UpdateOptions{}); !apierrors.IsConflict(err) {
			return
		}
	}
}

func (p *provider) get(ns, name string) (*podRun, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r, ok := p.pods[key(ns, name)]
	if !ok {
		return nil, errdefs.NotFoundf("pod %s/%s is not on this node", ns, name)
	}
	return r, nil
}

func (p *provider) GetPod(ctx context.Context, ns, name string) (*v1.Pod, error) {
	r, err := p.get(ns, name)
	if err != nil {
		return nil, err
	}
	return r.snapshot(), nil
}

func (p *provider) GetPodStatus(ctx context.Context, ns, name string) (*v1.PodStatus, error) {
	r, err := p.get(ns, name)
	if err != nil {
		return nil, err
	}
	return &r.snapshot().Status, nil
}

func (p *provider) GetPods(ctx context.Context) ([]*v1.Pod, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*v1.Pod, 0, len(p.pods))
	for _, r := range p.pods {
		out = append(out, r.snapshot())
	}
	return out, nil
}

// GetContainerLogs serves `kubectl logs` from the container's log files, one per run.
func (p *provider) GetContainerLogs(ctx context.Context, ns, name, container string, opts api.ContainerLogOpts) (io.ReadCloser, error) {
	r, err := p.get(ns, name)
	if err != nil {
		return nil, err
	}
	c := r.container(container)
	if c == nil {
		return nil, errdefs.NotFoundf("container %s not in pod %s/%s", container, ns, name)
	}
	r.mu.Lock()
	runs := c.status.RestartCount
	if c.status.State.Running == nil && c.status.State.Terminated == nil {
		runs-- // in back-off: the latest file is the previous run's
	}
	r.mu.Unlock()
	if opts.Previous {
		runs--
	}
	if runs < 0 {
		return nil, errdefs.NotFoundf("previous terminated container %q in pod %q not found", container, name)
	}
	path := c.logPath(int(runs))
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, errdefs.NotFoundf("no logs for container %s: %v", container, err)
	}
	if opts.Follow && !opts.Previous {
		r.mu.Lock()
		exited := c.exited
		r.mu.Unlock()
		if exited != nil {
			return follow(ctx, path, opts.Tail, exited)
		}
	}
	data = tail(data, opts.Tail)
	if opts.LimitBytes > 0 && len(data) > opts.LimitBytes {
		data = data[:opts.LimitBytes]
	}
	return io.NopCloser(strings.NewReader(string(data))), nil
}

func tail(data []byte, n int) []byte {
	if n <= 0 {
		return data
	}
	lines := strings.SplitAfter(string(data), "\n")
	if lines[len(lines)-1] == "" {
		lines = lines[:len(lines)-1]
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return []byte(strings.Join(lines, ""))
}

// follow streams a log file as it grows (`kubectl logs -f`) until the run ends or the
// client goes: first what is there (its last `lines` lines when set), then every byte after.
func follow(ctx context.Context, path string, lines int, exited <-chan struct{}) (io.ReadCloser, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	data, err := io.ReadAll(f) // leaves f at the end: nothing written meanwhile is lost
	if err != nil {
		f.Close()
		return nil, err
	}
	head := tail(data, lines)
	pr, pw := io.Pipe()
	go func() {
		defer f.Close()
		if _, err := pw.Write(head); err != nil {
			return
		}
		buf := make([]byte, 32*1024)
		for {
			n, err := f.Read(buf)
			if n > 0 {
				if _, werr := pw.Write(buf[:n]); werr != nil {
					return
				}
				continue
			}
			if err != nil && err != io.EOF {
				pw.CloseWithError(err)
				return
			}
			select {
			case <-ctx.Done():
				pw.Close()
				return
			case <-exited:
				// The process is gone: copy what it wrote last, then end the stream.
				_, _ = io.Copy(pw, f)
				pw.Close()
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	return pr, nil
}

func (p *provider) RunInContainer(ctx context.Context, ns, name, container string, cmd []string, attach api.AttachIO) error {
	return errdefs.InvalidInput("exec is not supported by the process node")
}

func (p *provider) AttachToContainer(ctx context.Context, ns, name, container string, attach api.AttachIO) error {
	return errdefs.InvalidInput("attach is not supported by the process node")
}

func (p *provider) GetStatsSummary(context.Context) (*statsv1alpha1.Summary, error) {
	return nil, errdefs.InvalidInput("stats are not supported by the process node")
}

func (p *provider) GetMetricsResource(context.Context) ([]*dto.MetricFamily, error) {
	return nil, errdefs.InvalidInput("metrics are not supported by the process node")
}

func (p *provider) PortForward(ctx context.Context, ns, pod string, port int32, stream io.ReadWriteCloser) error {
	return errdefs.InvalidInput("port-forward is not supported by the process node")
}

// podRun is one pod on this node: its namespace, volumes and containers.
type podRun struct {
	p   *provider
	dir string

	mu          sync.Mutex
	pod         *v1.Pod
	ip          string
	netns       string
	startTime   metav1.Time
	reason      string // why the pod cannot start (refused image, volume), shown on the pod
	message     string
	initialized bool
	netReady    bool
	stopping    bool
	sandboxGone bool
	done        bool
	inits       []*container
	ctrs        []*container
	mounts      map[string]string // volume name -> host directory
	ctx         context.Context
	cancel      context.CancelFunc
	finished    chan struct{}
}

func newPodRun(p *provider, pod *v1.Pod) *podRun {
	ctx, cancel := context.WithCancel(context.Background())
	r := &podRun{
		p: p, pod: pod.DeepCopy(), dir: filepath.Join(p.a.stateDir, "pods", string(pod.UID)),
		startTime: metav1.Now(), ctx: ctx, cancel: cancel, finished: make(chan struct{}),
	}
	for _, c := range pod.Spec.InitContainers {
		r.inits = append(r.inits, newContainer(r, c, true))
	}
	for _, c := range pod.Spec.Containers {
		r.ctrs = append(r.ctrs, newContainer(r, c, false))
	}
	return r
}

func (r *podRun) container(name string) *container {
	for _, c := range append(append([]*container{}, r.inits...), r.ctrs...) {
		if c.spec.Name == name {
			return c
		}
	}
	return nil
}

func (r *podRun) publish() {
	r.p.mu.Lock()
	notify := r.p.notify
	r.p.mu.Unlock()
	notify(r.snapshot())
}

func (r *podRun) fail(reason, message string) {
	r.mu.Lock()
	r.reason, r.message = reason, message
	r.mu.Unlock()
	r.p.rec.Event(r.pod, v1.EventTypeWarning, reason, message)
	r.publish()
}

func (r *podRun) run() {
	defer close(r.finished)
	pod := r.pod
	for _, c := range append(append([]*container{}, r.inits...), r.ctrs...) {
		if c.rule == nil {
			msg := fmt.Sprintf("Failed to pull image %q: the process node runs only images in its image table", c.spec.Image)
			r.mu.Lock()
			c.status.State = v1.ContainerState{Waiting: &v1.ContainerStateWaiting{Reason: "ErrImagePull", Message: msg}}
			r.mu.Unlock()
			r.fail("Failed", msg)
			return
		}
	}
	ip, err := r.p.a.net.allocate()
	if err != nil {
		r.fail("FailedCreatePodSandBox", err.Error())
		return
	}
	r.mu.Lock()
	r.ip = ip
	r.mu.Unlock()
	ns, err := setupPod(ip)
	if err != nil {
		r.p.a.net.release(ip)
		r.mu.Lock()
		r.ip = ""
		r.mu.Unlock()
		r.fail("FailedCreatePodSandBox", err.Error())
		return
	}
	r.mu.Lock()
	r.netns, r.netReady = ns, true
	r.mu.Unlock()
	// A ConfigMap, Secret or claim may come after the pod (or the informer may not have it
	// yet): as the kubelet does, keep trying until the pod is deleted.
	for attempt := 0; ; attempt++ {
		err := r.setupVolumes()
		if err == nil {
			break
		}
		if attempt%15 == 0 { // an Event every 30 s, not every try
			r.fail("FailedMount", err.Error())
		}
		select {
		case <-r.ctx.Done():
			return
		case <-time.After(volumeSyncPeriod):
		}
	}
	r.mu.Lock()
	r.reason, r.message = "", ""
	r.mu.Unlock()
	go r.syncVolumes()
	r.publish()
	for _, c := range r.inits {
		if !c.supervise(r.ctx) {
			if r.ctx.Err() == nil {
				r.releaseSandbox() // a failed init container with restartPolicy Never
			}
			r.publish()
			return
		}
	}
	r.mu.Lock()
	r.initialized = true
	r.mu.Unlock()
	r.publish()
	var wg sync.WaitGroup
	for _, c := range r.ctrs {
		wg.Add(1)
		go func() { defer wg.Done(); c.supervise(r.ctx) }()
	}
	wg.Wait()
	_ = pod
	if r.ctx.Err() == nil {
		// Every container is done for good (a Job's pod, say): as the kubelet does, the
		// sandbox and the volumes go now; the logs stay until the pod is deleted.
		r.releaseSandbox()
	}
	r.publish()
}

// releaseSandbox kills what is left in the pod's network namespace, removes it and the
// volumes with their mount points. The pod IP stays reserved (and reported) until stop.
func (r *podRun) releaseSandbox() {
	r.mu.Lock()
	ip, ns, gone := r.ip, r.netns, r.sandboxGone
	r.sandboxGone, r.netReady = true, false
	r.mu.Unlock()
	if gone {
		return
	}
	if ns != "" {
		killNamespace(ns)
		teardownPod(ip)
	}
	r.p.a.dirs.release(string(r.pod.UID))
	_ = os.RemoveAll(filepath.Join(r.dir, "volumes"))
}

// stop ends the pod as a kubelet does on delete: no more restarts, SIGTERM to every
// container, SIGKILL after the grace period, then the sandbox (namespace, volumes) goes.
func (r *podRun) stop(grace time.Duration) {
	r.mu.Lock()
	if r.stopping {
		r.mu.Unlock()
		<-r.finished
		return
	}
	r.stopping = true
	r.mu.Unlock()
	r.cancel()
	var wg sync.WaitGroup
	for _, c := range append(append([]*container{}, r.inits...), r.ctrs...) {
		wg.Add(1)
		go func() { defer wg.Done(); c.terminate(grace) }()
	}
	wg.Wait()
	<-r.finished
	r.releaseSandbox()
	r.mu.Lock()
	ip := r.ip
	r.mu.Unlock()
	if ip != "" {
		r.p.a.net.release(ip)
	}
	r.teardownVolumes()
	r.mu.Lock()
	r.done = true
	r.mu.Unlock()
	r.publish()
	log.G(context.Background()).Infof("pod %s/%s stopped", r.pod.Namespace, r.pod.Name)
}

// snapshot is the pod with the status a kubelet would report now.
func (r *podRun) snapshot() *v1.Pod {
	r.mu.Lock()
	defer r.mu.Unlock()
	pod := r.pod.DeepCopy()
	st := v1.PodStatus{
		HostIP:    "127.0.0.1",
		HostIPs:   []v1.HostIP{{IP: "127.0.0.1"}},
		StartTime: &r.startTime,
		QOSClass:  pod.Status.QOSClass,
		Reason:    r.reason,
		Message:   r.message,
	}
	if r.ip != "" {
		st.PodIP = r.ip
		st.PodIPs = []v1.PodIP{{IP: r.ip}}
	}
	allReady, anyRunning, allDone, allSucceeded := true, false, true, true
	for _, c := range r.inits {
		s := *c.status.DeepCopy()
		// The kubelet's prober: an init container is ready once it exited 0.
		s.Ready = s.State.Terminated != nil && s.State.Terminated.ExitCode == 0
		st.InitContainerStatuses = append(st.InitContainerStatuses, s)
	}
	for _, c := range r.ctrs {
		s := *c.status.DeepCopy()
		if r.done && s.State.Terminated == nil {
			// Stopped before it ran, or in back-off: a terminal pod has terminal containers.
			s.State = v1.ContainerState{Terminated: &v1.ContainerStateTerminated{ExitCode: 0, Reason: "Completed", FinishedAt: metav1.Now()}}
			if s.LastTerminationState.Terminated != nil {
				s.State.Terminated = s.LastTerminationState.Terminated.DeepCopy()
			}
		}
		st.ContainerStatuses = append(st.ContainerStatuses, s)
		allReady = allReady && s.Ready
		anyRunning = anyRunning || s.State.Running != nil
		if !c.finished {
			allDone = false
		}
		if s.State.Terminated == nil || s.State.Terminated.ExitCode != 0 {
			allSucceeded = false
		}
	}
	initFailed := false
	for _, c := range r.inits {
		if c.finished && (c.status.State.Terminated == nil || c.status.State.Terminated.ExitCode != 0) {
			initFailed = true
		}
	}
	switch {
	case r.done || initFailed:
		st.Phase = v1.PodFailed
		if allSucceeded && !initFailed {
			st.Phase = v1.PodSucceeded
		}
	case r.initialized && allDone:
		st.Phase = v1.PodFailed
		if allSucceeded {
			st.Phase = v1.PodSucceeded
		}
	case r.initialized && (anyRunning || r.anyStarted()):
		st.Phase = v1.PodRunning
	default:
		st.Phase = v1.PodPending
	}
	ready := allReady && r.initialized && !r.done && !r.stopping
	cond := func(t v1.PodConditionType, ok bool, reason string) v1.PodCondition {
		c := v1.PodCondition{Type: t, Status: v1.ConditionFalse, Reason: reason}
		if ok {
			c.Status, c.Reason = v1.ConditionTrue, ""
		}
		// Keep the transition time while the status does not change.
		c.LastTransitionTime = metav1.Now()
		for _, old := range r.pod.Status.Conditions {
			if old.Type == t && old.Status == c.Status {
				c.LastTransitionTime = old.LastTransitionTime
			}
		}
		return c
	}
	st.Conditions = []v1.PodCondition{
		cond(v1.PodReadyToStartContainers, r.netReady && !r.done, "SandboxNotReady"),
		cond(v1.PodInitialized, r.initialized, "ContainersNotInitialized"),
		cond(v1.ContainersReady, ready, "ContainersNotReady"),
		cond(v1.PodReady, ready, "ContainersNotReady"),
		cond(v1.PodScheduled, true, ""),
	}
	if r.reason == "" && r.ip == "" && !r.done {
		st.Conditions[0].Reason = "SandboxNotReady"
	}
	r.pod.Status.Conditions = st.Conditions
	pod.Status = st
	return pod
}

// anyStarted: a container between runs (back-off) still counts the pod as Running.
func (r *podRun) anyStarted() bool {
	for _, c := range r.ctrs {
		if c.status.RestartCount > 0 || c.status.State.Terminated != nil {
			return true
		}
	}
	return false
}

func killPid(pid int) error { return syscall.Kill(pid, syscall.SIGKILL) }
