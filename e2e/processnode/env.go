package main

import (
	"fmt"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
)

// expand replaces $(VAR) with vars[VAR] as the kubelet does: $$ escapes a $, and a reference
// to an unknown variable is left as written.
func expand(s string, vars map[string]string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 >= len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				b.WriteString(s[i:])
				return b.String()
			}
			name := s[i+2 : i+2+end]
			if v, ok := vars[name]; ok {
				b.WriteString(v)
			} else {
				b.WriteString(s[i : i+3+end])
			}
			i += 2 + end
		default:
			b.WriteByte('$')
		}
	}
	return b.String()
}

// lookups is what env resolution reads from the cluster.
type lookups interface {
	configMap(ns, name string) (*v1.ConfigMap, error)
	secret(ns, name string) (*v1.Secret, error)
}

// fieldRef resolves the downward API fields a kubelet offers in env.
func fieldRef(pod *v1.Pod, podIP, path string) (string, error) {
	switch path {
	case "metadata.name":
		return pod.Name, nil
	case "metadata.namespace":
		return pod.Namespace, nil
	case "metadata.uid":
		return string(pod.UID), nil
	case "spec.nodeName":
		return pod.Spec.NodeName, nil
	case "spec.serviceAccountName":
		return pod.Spec.ServiceAccountName, nil
	case "status.podIP":
		return podIP, nil
	case "status.podIPs":
		return podIP, nil
	case "status.hostIP", "status.hostIPs":
		return "127.0.0.1", nil
	}
	for _, prefix := range []string{"metadata.labels['", "metadata.annotations['"} {
		if strings.HasPrefix(path, prefix) && strings.HasSuffix(path, "']") {
			key := strings.TrimSuffix(strings.TrimPrefix(path, prefix), "']")
			if strings.HasPrefix(prefix, "metadata.labels") {
				return pod.Labels[key], nil
			}
			return pod.Annotations[key], nil
		}
	}
	return "", fmt.Errorf("unsupported fieldRef %q", path)
}

// containerEnv builds the container's environment in the kubelet's order: the image's ENV,
// the `kubernetes` Service variables, envFrom, then env (each value expanded against what
// came before).
func containerEnv(pod *v1.Pod, c *v1.Container, podIP string, rule *imageRule, apiHost, apiPort string, l lookups) (map[string]string, error) {
	vars := map[string]string{}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	if len(rule.Path) > 0 {
		path = strings.Join(rule.Path, ":") + ":" + path
	}
	vars["PATH"] = path
	vars["HOSTNAME"] = pod.Name
	for k, v := range rule.Env {
		vars[k] = v
	}
	vars["KUBERNETES_SERVICE_HOST"] = apiHost
	vars["KUBERNETES_SERVICE_PORT"] = apiPort
	vars["KUBERNETES_SERVICE_PORT_HTTPS"] = apiPort
	vars["KUBERNETES_PORT"] = "tcp://" + apiHost + ":" + apiPort
	ns := pod.Namespace
	for _, from := range c.EnvFrom {
		var data map[string]string
		optional := false
		switch {
		case from.ConfigMapRef != nil:
			optional = from.ConfigMapRef.Optional != nil && *from.ConfigMapRef.Optional
			cm, err := l.configMap(ns, from.ConfigMapRef.Name)
			if err != nil {
				if optional {
					continue
				}
				return nil, fmt.Errorf("configmap %q: %w", from.ConfigMapRef.Name, err)
			}
			data = cm.Data
		case from.SecretRef != nil:
			optional = from.SecretRef.Optional != nil && *from.SecretRef.Optional
			s, err := l.secret(ns, from.SecretRef.Name)
			if err != nil {
				if optional {
					continue
				}
				return nil, fmt.Errorf("secret %q: %w", from.SecretRef.Name, err)
			}
			data = map[string]string{}
			for k, v := range s.Data {
				data[k] = string(v)
			}
		}
		for k, v := range data {
			vars[from.Prefix+k] = v
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			vars[e.Name] = expand(e.Value, vars)
			continue
		}
		vf := e.ValueFrom
		switch {
		case vf.FieldRef != nil:
			v, err := fieldRef(pod, podIP, vf.FieldRef.FieldPath)
			if err != nil {
				return nil, err
			}
			vars[e.Name] = v
		case vf.ConfigMapKeyRef != nil:
			ref := vf.ConfigMapKeyRef
			cm, err := l.configMap(ns, ref.Name)
			v, ok := "", false
			if err == nil {
				v, ok = cm.Data[ref.Key]
			}
			if !ok {
				if ref.Optional != nil && *ref.Optional {
					continue
				}
				return nil, fmt.Errorf("couldn't find key %s in ConfigMap %s/%s", ref.Key, ns, ref.Name)
			}
			vars[e.Name] = v
		case vf.SecretKeyRef != nil:
			ref := vf.SecretKeyRef
			s, err := l.secret(ns, ref.Name)
			var v []byte
			ok := false
			if err == nil {
				v, ok = s.Data[ref.Key]
			}
			if !ok {
				if ref.Optional != nil && *ref.Optional {
					continue
				}
				return nil, fmt.Errorf("couldn't find key %s in Secret %s/%s", ref.Key, ns, ref.Name)
			}
			vars[e.Name] = string(v)
		case vf.ResourceFieldRef != nil:
			vars[e.Name] = resourceField(c, vf.ResourceFieldRef)
		}
	}
	return vars, nil
}

func resourceField(c *v1.Container, ref *v1.ResourceFieldSelector) string {
	kind, name, _ := strings.Cut(ref.Resource, ".")
	list := c.Resources.Limits
	if kind == "requests" {
		list = c.Resources.Requests
	}
	q, ok := list[v1.ResourceName(name)]
	if !ok {
		return "0"
	}
	if name == "cpu" {
		return fmt.Sprint(q.MilliValue()/1000 + min(1, q.MilliValue()%1000))
	}
	return fmt.Sprint(q.Value())
}

func envList(vars map[string]string) []string {
	out := make([]string, 0, len(vars))
	for k, v := range vars {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

// commandLine is the container's argv: command/args override the image's entrypoint/cmd as
// in Docker, with $(VAR) expanded against the container's environment.
func commandLine(c *v1.Container, rule *imageRule, vars map[string]string) []string {
	entry, cmd := rule.Entrypoint, rule.Cmd
	if len(c.Command) > 0 {
		entry, cmd = c.Command, nil
	}
	if len(c.Args) > 0 {
		cmd = c.Args
	}
	var argv []string
	for _, a := range append(append([]string{}, entry...), cmd...) {
		argv = append(argv, expand(a, vars))
	}
	return argv
}
