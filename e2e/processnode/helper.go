package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
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
	var mounts []mount
	for len(args) > 0 && args[0] != "--" {
		switch {
		case args[0] == "--mount" && len(args) > 1:
			parts := strings.Split(args[1], ":")
			if len(parts) < 2 {
				return fail("bad mount %q", args[1])
			}
			mounts = append(mounts, mount{src: parts[0], dst: parts[1], readOnly: len(parts) > 2 && parts[2] == "ro"})
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
	if err := mountAll(mounts); err != nil {
		return fail("%v", err)
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

// mountAll bind-mounts every volume. Each source is opened before anything is mounted and
// mounted through /proc/self/fd: a volume mounted at /tmp would otherwise hide the sources
// of the others when they live under /tmp. Parents go before children, as runtimes order
// them, so a mountPath inside another volume lands on top of it.
func mountAll(mounts []mount) error {
	fds := make([]int, len(mounts))
	for i, m := range mounts {
		fd, err := unix.Open(m.src, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("volume %s: %w", m.src, err)
		}
		fds[i] = fd
	}
	order := make([]int, len(mounts))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool {
		return strings.Count(filepath.Clean(mounts[order[a]].dst), "/") < strings.Count(filepath.Clean(mounts[order[b]].dst), "/")
	})
	for _, i := range order {
		m := mounts[i]
		// Inside a volume mounted before, the mount point is made in that volume.
		if _, err := os.Lstat(m.dst); os.IsNotExist(err) {
			var st syscall.Stat_t
			if err := syscall.Fstat(fds[i], &st); err != nil {
				return err
			}
			if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
				err = os.MkdirAll(m.dst, 0o755)
			} else if err = os.MkdirAll(filepath.Dir(m.dst), 0o755); err == nil {
				err = os.WriteFile(m.dst, nil, 0o644)
			}
			if err != nil {
				return fmt.Errorf("mount point %s: %w", m.dst, err)
			}
		}
		if err := bindMount(fmt.Sprintf("/proc/self/fd/%d", fds[i]), m.dst, m.readOnly); err != nil {
			return fmt.Errorf("mount %s at %s: %w", m.src, m.dst, err)
		}
		syscall.Close(fds[i])
	}
	return nil
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
