package main

import (
	"fmt"
	"reflect"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestExpandFollowsTheKubelet(t *testing.T) {
	vars := map[string]string{"A": "one", "B": "$(A)"}
	for in, want := range map[string]string{
		"$(A)":         "one",
		"x$(A)y$(A)":   "x" + "one" + "y" + "one",
		"$$(A)":        "$(A)", // $$ escapes: the reference stays as written
		"$(MISSING)":   "$(MISSING)",
		"$A":           "$A",   // only $(...) is a reference
		"$(B)":         "$(A)", // values are not expanded twice
		"trailing $":   "trailing $",
		"$(unclosed":   "$(unclosed",
		"cost: $$5":    "cost: $5",
		"":             "",
		"$(A)$(A)$(A)": "oneoneone",
	} {
		if got := expand(in, vars); got != want {
			t.Errorf("expand(%q) = %q, want %q", in, got, want)
		}
	}
}

type fakeLookups struct {
	cms     map[string]*v1.ConfigMap
	secrets map[string]*v1.Secret
}

func (f fakeLookups) configMap(ns, name string) (*v1.ConfigMap, error) {
	if cm, ok := f.cms[ns+"/"+name]; ok {
		return cm, nil
	}
	return nil, fmt.Errorf("not found")
}

func (f fakeLookups) secret(ns, name string) (*v1.Secret, error) {
	if s, ok := f.secrets[ns+"/"+name]; ok {
		return s, nil
	}
	return nil, fmt.Errorf("not found")
}

func TestContainerEnvResolvesInTheKubeletsOrder(t *testing.T) {
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", Labels: map[string]string{"app": "web"}},
		Spec:       v1.PodSpec{NodeName: "node-a"},
	}
	optional := true
	c := &v1.Container{
		EnvFrom: []v1.EnvFromSource{{Prefix: "CM_", ConfigMapRef: &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: "cfg"}}}},
		Env: []v1.EnvVar{
			{Name: "IP", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "status.podIP"}}},
			{Name: "URL", Value: "http://$(IP):$(CM_port)/"},
			{Name: "NODE", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}},
			{Name: "APP", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.labels['app']"}}},
			{Name: "TOKEN", ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "s"}, Key: "t"}}},
			{Name: "GONE", ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "s"}, Key: "nope", Optional: &optional}}},
			{Name: "PATH", Value: "/override:$(PATH)"},
		},
	}
	l := fakeLookups{
		cms:     map[string]*v1.ConfigMap{"ns/cfg": {Data: map[string]string{"port": "8000"}}},
		secrets: map[string]*v1.Secret{"ns/s": {Data: map[string][]byte{"t": []byte("tok")}}},
	}
	rule := &imageRule{Path: []string{"/venv/bin"}, Env: map[string]string{"IMAGE_ENV": "1"}}
	vars, err := containerEnv(pod, c, "10.244.1.2", rule, "10.96.0.1", "443", l)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"IP": "10.244.1.2", "URL": "http://10.244.1.2:8000/", "NODE": "node-a", "APP": "web",
		"TOKEN": "tok", "CM_port": "8000", "IMAGE_ENV": "1", "HOSTNAME": "p",
		"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
		"PATH": "/override:/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	}
	for k, v := range want {
		if vars[k] != v {
			t.Errorf("%s = %q, want %q", k, vars[k], v)
		}
	}
	if _, ok := vars["GONE"]; ok {
		t.Error("an optional missing key must leave the variable unset")
	}

	c.Env = append(c.Env, v1.EnvVar{Name: "MISSING", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "cfg"}, Key: "absent"}}})
	if _, err := containerEnv(pod, c, "10.244.1.2", rule, "10.96.0.1", "443", l); err == nil {
		t.Error("a required missing key must be an error (CreateContainerConfigError)")
	}
}

func TestCommandLineOverridesTheImageAsDockerDoes(t *testing.T) {
	rule := &imageRule{Entrypoint: []string{"fleetpilot"}, Cmd: []string{"--help"}}
	vars := map[string]string{"PORT": "8000"}
	for _, tc := range []struct {
		command, args, want []string
	}{
		{nil, nil, []string{"fleetpilot", "--help"}},
		{nil, []string{"engine", "--port=$(PORT)"}, []string{"fleetpilot", "engine", "--port=8000"}},
		{[]string{"python"}, nil, []string{"python"}}, // command drops the image's CMD too
		{[]string{"python", "-m"}, []string{"http.server", "$(PORT)"}, []string{"python", "-m", "http.server", "8000"}},
	} {
		c := &v1.Container{Command: tc.command, Args: tc.args}
		if got := commandLine(c, rule, vars); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("command %v args %v: got %v, want %v", tc.command, tc.args, got, tc.want)
		}
	}
}

func TestImageTableMatchesExactlyOrByPrefix(t *testing.T) {
	table := &imageTable{Images: []imageRule{
		{Pattern: "ghcr.io/fleetpilot/fleetpilot:*", Entrypoint: []string{"a"}},
		{Pattern: "busybox:1.36", Entrypoint: []string{"b"}},
	}}
	for image, want := range map[string]string{
		"ghcr.io/fleetpilot/fleetpilot:0.1.0": "a",
		"ghcr.io/fleetpilot/fleetpilot:":      "a",
		"busybox:1.36":                        "b",
		"busybox:1.37":                        "",
		"ghcr.io/fleetpilot/fleetpilot-x:1":   "",
		"docker.io/library/nginx:1.27":        "",
	} {
		got := ""
		if r := table.lookup(image); r != nil {
			got = r.Entrypoint[0]
		}
		if got != want {
			t.Errorf("lookup(%q) = %q, want %q", image, got, want)
		}
	}
}

func TestTailKeepsTheLastLines(t *testing.T) {
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"a\nb\nc\n", 2, "b\nc\n"},
		{"a\nb\nc", 2, "b\nc"},
		{"a\n", 5, "a\n"},
		{"a\nb\n", 0, "a\nb\n"},
	} {
		if got := string(tail([]byte(tc.in), tc.n)); got != tc.want {
			t.Errorf("tail(%q, %d) = %q, want %q", tc.in, tc.n, got, tc.want)
		}
	}
}
