package main

import (
	"os"
	"path/filepath"
	"testing"
)

func TestDirTrackerRemovesOnlyWhatItMadeWhenTheLastPodGoes(t *testing.T) {
	root := t.TempDir()
	existing := filepath.Join(root, "etc")
	if err := os.Mkdir(existing, 0o755); err != nil {
		t.Fatal(err)
	}
	d := newDirTracker()
	deep := filepath.Join(existing, "fleetpilot", "auth")
	if err := d.ensure("pod-a", deep, false); err != nil {
		t.Fatal(err)
	}
	if err := d.ensure("pod-b", filepath.Join(existing, "fleetpilot"), false); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(existing, "fleetpilot", "token")
	if err := d.ensure("pod-b", file, true); err != nil {
		t.Fatal(err)
	}
	d.release("pod-a")
	if _, err := os.Stat(deep); !os.IsNotExist(err) {
		t.Errorf("%s should go with its only pod: %v", deep, err)
	}
	if _, err := os.Stat(file); err != nil {
		t.Errorf("pod-b still uses %s: %v", file, err)
	}
	d.release("pod-b")
	if _, err := os.Stat(filepath.Join(existing, "fleetpilot")); !os.IsNotExist(err) {
		t.Errorf("made for the pods, it should be gone: %v", err)
	}
	if _, err := os.Stat(existing); err != nil {
		t.Errorf("%s was there before: it must stay: %v", existing, err)
	}
}

func TestSyncDirWritesChangesAndRemovesDroppedKeys(t *testing.T) {
	dir := t.TempDir()
	if err := syncDir(dir, map[string]file{"a": {[]byte("1"), 0o644}, "sub/b": {[]byte("2"), 0o600}}); err != nil {
		t.Fatal(err)
	}
	if err := syncDir(dir, map[string]file{"a": {[]byte("changed"), 0o644}}); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "a")); string(got) != "changed" {
		t.Errorf("a = %q", got)
	}
	if _, err := os.Stat(filepath.Join(dir, "sub", "b")); !os.IsNotExist(err) {
		t.Errorf("a key no longer in the ConfigMap must go: %v", err)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.Name() != "a" && e.Name() != "sub" {
			t.Errorf("left behind: %s", e.Name())
		}
	}
}
