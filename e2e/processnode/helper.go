package main

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
)

// helperCommand is how the agent re-executes itself inside a pod: `ip netns exec` has entered
// the pod's network namespace and a fresh mount namespace (with / a slave of the host's, so
// nothing mounted here propagates back); the helper bind-mounts the pod's volumes, changes
// directory and execs the container's command. The process keeps its pid, so the agent's
// process group and signals reach the container's command itself.
const helperCommand = "pod-exec"

// helperArgs is the helper's command line: --mount SRC:DST[:ro] ... [--workdir DIR] -- CMD...
func helperArgs(mounts []mount, workdir string, argv []string) []string {
	args := []string{helperCommand}
	for _, m := range mounts {
		spec := m.src + ":" + m.dst
		if m.readOnly {
			spec += ":ro"
		}
		args = append(args, "--mount", spec)
	}
	if workdir != "" {
		args = append(args, "--workdir", workdir)
	}
	return append(append(args, "--"), argv...)
}

func runHelper(args []string) int {
	fail := func(format string, a ...any) int {
		fmt.Fprintf(os.Stderr, "processnode pod-exec: "+format+"\n", a...)
		return 127
	}
	workdir := ""
	for len(args) > 0 && args[0] != "--" {
		switch {
		case args[0] == "--mount" && len(args) > 1:
			parts := strings.Split(args[1], ":")
			if err := bindMount(parts[0], parts[1], len(parts) > 2 && parts[2] == "ro"); err != nil {
				return fail("mount %s: %v", args[1], err)
			}
			args = args[2:]
		case args[0] == "--workdir" && len(args) > 1:
			workdir = args[1]
			args = args[2:]
		default:
			return fail("bad argument %q", args[0])
		}
	}
	if len(args) < 2 {
		return fail("no command")
	}
	argv := args[1:]
	if workdir != "" {
		if err := os.Chdir(workdir); err != nil {
			return fail("workingDir: %v", err)
		}
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return fail("%v", err)
	}
	err = syscall.Exec(path, argv, os.Environ())
	return fail("exec %s: %v", path, err)
}

func bindMount(src, dst string, readOnly bool) error {
	if err := syscall.Mount(src, dst, "", syscall.MS_BIND|syscall.MS_REC, ""); err != nil {
		return err
	}
	if readOnly {
		return syscall.Mount("", dst, "", syscall.MS_BIND|syscall.MS_REMOUNT|syscall.MS_RDONLY|syscall.MS_REC, "")
	}
	return nil
}
