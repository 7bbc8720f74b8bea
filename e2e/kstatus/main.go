// Command kstatus prints the status Flux (and kpt, cli-utils' applier) compute for Kubernetes
// objects: sigs.k8s.io/cli-utils' kstatus, the real library, not a reading of its rules.
//
// It reads a JSON object, or a JSON array of objects, on stdin (objects as the API server
// returns them) and writes one JSON line per object: {"status": ..., "message": ...}.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type result struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	raw, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(err)
	}
	var objects []json.RawMessage
	if err := json.Unmarshal(raw, &objects); err != nil {
		objects = []json.RawMessage{raw}
	}
	encoder := json.NewEncoder(os.Stdout)
	for _, object := range objects {
		// The apimachinery decoder, so that integers stay int64 as kstatus expects.
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(object); err != nil {
			fail(fmt.Errorf("not a Kubernetes object: %w", err))
		}
		computed, err := status.Compute(u)
		if err != nil {
			fail(err)
		}
		if err := encoder.Encode(result{string(computed.Status), computed.Message}); err != nil {
			fail(err)
		}
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "kstatus:", err)
	os.Exit(2)
}
