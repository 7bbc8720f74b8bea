package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/virtual-kubelet/virtual-kubelet/log"
	authv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// mount is one bind mount the helper makes in the container's mount namespace.
type mount struct {
	src, dst string
	readOnly bool
}

// volumeSyncPeriod: ConfigMap, Secret and projected contents are rewritten this often; the
// kubelet's own delay is its sync period plus the cache TTL (about a minute by default).
const volumeSyncPeriod = 2 * time.Second

func (r *podRun) volumeDir(name string) string { return filepath.Join(r.dir, "volumes", name) }

// defaultHome gives a container that neither its image table entry nor its pod sets HOME
// for a home of the pod's own: in a cluster HOME lies in the container's private
// filesystem, so what a process writes there (caches, say) goes with it; here it would
// otherwise land in the agent's home on the host and stay.
func (r *podRun) defaultHome(vars map[string]string) {
	if _, ok := vars["HOME"]; !ok {
		vars["HOME"] = filepath.Join(r.dir, "home")
	}
}

// setupVolumes makes each volume's directory and the mountPaths on the host (the bind mounts
// themselves happen in each container's own mount namespace).
func (r *podRun) setupVolumes() error {
	if err := os.MkdirAll(filepath.Join(r.dir, "home"), 0o755); err != nil {
		return err
	}
	mounts := map[string]string{}
	for _, vol := range r.pod.Spec.Volumes {
		dir := r.volumeDir(vol.Name)
		switch {
		case vol.HostPath != nil:
			dir = vol.HostPath.Path
			if t := vol.HostPath.Type; t != nil && *t == v1.HostPathDirectoryOrCreate {
				if err := os.MkdirAll(dir, 0o755); err != nil {
					return err
				}
			}
		case vol.PersistentVolumeClaim != nil:
			path, err := r.claimPath(vol.PersistentVolumeClaim.ClaimName)
			if err != nil {
				return err
			}
			dir = path
		case vol.EmptyDir != nil, vol.ConfigMap != nil, vol.Secret != nil, vol.Projected != nil, vol.DownwardAPI != nil:
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return err
			}
		default:
			return fmt.Errorf("volume %q: this kind of volume is not supported by the process node", vol.Name)
		}
		mounts[vol.Name] = dir
	}
	r.mu.Lock()
	r.mounts = mounts
	r.mu.Unlock()
	if err := r.writeVolumes(true); err != nil {
		return err
	}
	for _, c := range append(append([]v1.Container{}, r.pod.Spec.InitContainers...), r.pod.Spec.Containers...) {
		for _, m := range r.mountsFor(&c) {
			info, err := os.Stat(m.src)
			if err != nil {
				return fmt.Errorf("volume mount %s: %w", m.dst, err)
			}
			if err := r.p.a.dirs.ensure(string(r.pod.UID), m.dst, !info.IsDir()); err != nil {
				return err
			}
		}
	}
	return nil
}

func (r *podRun) mountsFor(c *v1.Container) []mount {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []mount
	for _, vm := range c.VolumeMounts {
		src, ok := r.mounts[vm.Name]
		if !ok {
			continue
		}
		if vm.SubPath != "" {
			src = filepath.Join(src, vm.SubPath)
		}
		out = append(out, mount{src: src, dst: vm.MountPath, readOnly: vm.ReadOnly})
	}
	return out
}

// claimPath: a PVC must be bound to a PersistentVolume with a hostPath (the harness makes
// them); its directory is bind-mounted.
func (r *podRun) claimPath(claim string) (string, error) {
	ctx := context.Background()
	pvc, err := r.p.a.client.CoreV1().PersistentVolumeClaims(r.pod.Namespace).Get(ctx, claim, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("claim %s: %w", claim, err)
	}
	if pvc.Spec.VolumeName == "" {
		return "", fmt.Errorf("claim %s is not bound", claim)
	}
	pv, err := r.p.a.client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	if pv.Spec.HostPath == nil {
		return "", fmt.Errorf("volume %s of claim %s has no hostPath: the process node mounts only those", pv.Name, claim)
	}
	return pv.Spec.HostPath.Path, nil
}

// syncVolumes keeps ConfigMap, Secret and projected volumes up to date, as the kubelet does.
func (r *podRun) syncVolumes() {
	for {
		select {
		case <-r.ctx.Done():
			return
		case <-time.After(volumeSyncPeriod):
		}
		if err := r.writeVolumes(false); err != nil {
			log.G(r.ctx).WithError(err).Warnf("pod %s/%s: volume sync", r.pod.Namespace, r.pod.Name)
		}
	}
}

type file struct {
	data []byte
	mode os.FileMode
}

func mode(item *int32, def *int32) os.FileMode {
	if item != nil {
		return os.FileMode(*item)
	}
	if def != nil {
		return os.FileMode(*def)
	}
	return 0o644
}

func project(files map[string]file, data map[string][]byte, items []v1.KeyToPath, def *int32) {
	if len(items) == 0 {
		for k, v := range data {
			files[k] = file{v, mode(nil, def)}
		}
		return
	}
	for _, it := range items {
		if v, ok := data[it.Key]; ok {
			files[it.Path] = file{v, mode(it.Mode, def)}
		}
	}
}

func (r *podRun) configMapData(name string, optional *bool) (map[string][]byte, error) {
	cm, err := r.p.configMap(r.pod.Namespace, name)
	if err != nil {
		if optional != nil && *optional {
			return nil, nil
		}
		return nil, fmt.Errorf("configmap %q: %w", name, err)
	}
	out := map[string][]byte{}
	for k, v := range cm.Data {
		out[k] = []byte(v)
	}
	for k, v := range cm.BinaryData {
		out[k] = v
	}
	return out, nil
}

func (r *podRun) secretData(name string, optional *bool) (map[string][]byte, error) {
	s, err := r.p.secret(r.pod.Namespace, name)
	if err != nil {
		if optional != nil && *optional {
			return nil, nil
		}
		return nil, fmt.Errorf("secret %q: %w", name, err)
	}
	return s.Data, nil
}

// writeVolumes computes every API-backed volume's files and writes what changed.
func (r *podRun) writeVolumes(first bool) error {
	for _, vol := range r.pod.Spec.Volumes {
		files := map[string]file{}
		switch {
		case vol.ConfigMap != nil:
			data, err := r.configMapData(vol.ConfigMap.Name, vol.ConfigMap.Optional)
			if err != nil {
				return err
			}
			project(files, data, vol.ConfigMap.Items, vol.ConfigMap.DefaultMode)
		case vol.Secret != nil:
			data, err := r.secretData(vol.Secret.SecretName, vol.Secret.Optional)
			if err != nil {
				return err
			}
			project(files, data, vol.Secret.Items, vol.Secret.DefaultMode)
		case vol.DownwardAPI != nil:
			for _, it := range vol.DownwardAPI.Items {
				if err := r.downward(files, it, vol.DownwardAPI.DefaultMode); err != nil {
					return err
				}
			}
		case vol.Projected != nil:
			def := vol.Projected.DefaultMode
			for _, src := range vol.Projected.Sources {
				switch {
				case src.ConfigMap != nil:
					data, err := r.configMapData(src.ConfigMap.Name, src.ConfigMap.Optional)
					if err != nil {
						return err
					}
					project(files, data, src.ConfigMap.Items, def)
				case src.Secret != nil:
					data, err := r.secretData(src.Secret.Name, src.Secret.Optional)
					if err != nil {
						return err
					}
					project(files, data, src.Secret.Items, def)
				case src.DownwardAPI != nil:
					for _, it := range src.DownwardAPI.Items {
						if err := r.downward(files, it, def); err != nil {
							return err
						}
					}
				case src.ServiceAccountToken != nil:
					tok, err := r.token(vol.Name, src.ServiceAccountToken)
					if err != nil {
						return err
					}
					files[src.ServiceAccountToken.Path] = file{[]byte(tok), mode(nil, def)}
				}
			}
		default:
			continue
		}
		if err := syncDir(r.volumeDir(vol.Name), files); err != nil {
			return err
		}
	}
	return nil
}

func (r *podRun) downward(files map[string]file, it v1.DownwardAPIVolumeFile, def *int32) error {
	if it.FieldRef == nil {
		return nil // resourceFieldRef: not offered in volumes here
	}
	r.mu.Lock()
	ip := r.ip
	r.mu.Unlock()
	v, err := fieldRef(r.pod, ip, it.FieldRef.FieldPath)
	if err != nil {
		if it.FieldRef.FieldPath == "metadata.labels" || it.FieldRef.FieldPath == "metadata.annotations" {
			m := r.pod.Labels
			if it.FieldRef.FieldPath == "metadata.annotations" {
				m = r.pod.Annotations
			}
			keys := make([]string, 0, len(m))
			for k := range m {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			var b strings.Builder
			for _, k := range keys {
				fmt.Fprintf(&b, "%s=%q\n", k, m[k])
			}
			v, err = b.String(), nil
		}
		if err != nil {
			return err
		}
	}
	files[it.Path] = file{[]byte(v), mode(it.Mode, def)}
	return nil
}

type token struct {
	value   string
	expires time.Time
	issued  time.Time
}

var (
	tokensMu sync.Mutex
	tokens   = map[string]token{}
)

// token asks the TokenRequest API for the pod's ServiceAccount token, bound to the pod, and
// renews it after 80% of its life as the kubelet does.
func (r *podRun) token(vol string, src *v1.ServiceAccountTokenProjection) (string, error) {
	k := string(r.pod.UID) + "/" + vol + "/" + src.Path
	tokensMu.Lock()
	t, ok := tokens[k]
	tokensMu.Unlock()
	if ok && time.Since(t.issued) < t.expires.Sub(t.issued)*8/10 {
		return t.value, nil
	}
	sa := r.pod.Spec.ServiceAccountName
	if sa == "" {
		sa = "default"
	}
	exp := int64(3600)
	if src.ExpirationSeconds != nil {
		exp = *src.ExpirationSeconds
	}
	req := &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		ExpirationSeconds: &exp,
		BoundObjectRef:    &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: r.pod.Name, UID: r.pod.UID},
	}}
	if src.Audience != "" {
		req.Spec.Audiences = []string{src.Audience}
	}
	resp, err := r.p.a.client.CoreV1().ServiceAccounts(r.pod.Namespace).CreateToken(context.Background(), sa, req, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("token for service account %s: %w", sa, err)
	}
	tokensMu.Lock()
	tokens[k] = token{value: resp.Status.Token, expires: resp.Status.ExpirationTimestamp.Time, issued: time.Now()}
	tokensMu.Unlock()
	return resp.Status.Token, nil
}

// syncDir makes dir hold exactly files: changed files are replaced by rename, so a reader sees
// the old or the new content, never half of it.
func syncDir(dir string, files map[string]file) error {
	for name, f := range files {
		path := filepath.Join(dir, name)
		if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, f.data) {
			continue
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		tmp := filepath.Join(filepath.Dir(path), ".tmp-"+filepath.Base(path))
		if err := os.WriteFile(tmp, f.data, f.mode); err != nil {
			return err
		}
		if err := os.Chmod(tmp, f.mode); err != nil {
			return err
		}
		if err := os.Rename(tmp, path); err != nil {
			return err
		}
	}
	return filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		if _, ok := files[rel]; !ok {
			return os.Remove(path)
		}
		return nil
	})
}

func (r *podRun) teardownVolumes() {
	tokensMu.Lock()
	for k := range tokens {
		if strings.HasPrefix(k, string(r.pod.UID)+"/") {
			delete(tokens, k)
		}
	}
	tokensMu.Unlock()
	_ = os.RemoveAll(r.dir)
}

// dirTracker remembers the mountPaths the agent had to create on the host (the bind mounts
// need a directory or file to mount over), which pods use them, and removes them when the
// last such pod is gone, so no directory is left behind.
type dirTracker struct {
	mu      sync.Mutex
	created map[string]map[string]bool // path -> pods using it
}

func newDirTracker() *dirTracker { return &dirTracker{created: map[string]map[string]bool{}} }

func (d *dirTracker) ensure(pod, path string, isFile bool) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var missing []string
	for p := filepath.Clean(path); ; p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil {
			break
		}
		missing = append(missing, p)
		if p == "/" {
			break
		}
	}
	for i := len(missing) - 1; i >= 0; i-- {
		p := missing[i]
		var err error
		if i == 0 && isFile {
			var f *os.File
			if f, err = os.OpenFile(p, os.O_CREATE|os.O_EXCL, 0o644); err == nil {
				f.Close()
			}
		} else {
			err = os.Mkdir(p, 0o755)
		}
		if err != nil {
			return err
		}
		d.created[p] = map[string]bool{}
	}
	for p := filepath.Clean(path); ; p = filepath.Dir(p) {
		users, ok := d.created[p]
		if !ok {
			break
		}
		users[pod] = true
	}
	return nil
}

func (d *dirTracker) release(pod string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var gone []string
	for p, users := range d.created {
		delete(users, pod)
		if len(users) == 0 {
			gone = append(gone, p)
		}
	}
	// Deepest first, so each directory is empty when its turn comes.
	sort.Slice(gone, func(i, j int) bool { return len(gone[i]) > len(gone[j]) })
	for _, p := range gone {
		if err := os.Remove(p); err == nil || os.IsNotExist(err) {
			delete(d.created, p)
		}
	}
}

func (d *dirTracker) removeAll() {
	d.mu.Lock()
	pods := map[string]bool{}
	for _, users := range d.created {
		for u := range users {
			pods[u] = true
		}
	}
	d.mu.Unlock()
	for p := range pods {
		d.release(p)
	}
	d.release("")
}
