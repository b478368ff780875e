// Command gitops-health judges one Kubernetes object the way Flux and Argo CD do, with their own
// code, for the tests of examples/gitops (tests/tests/gitops.rs). It reads the object as JSON on
// stdin and prints one JSON line {"status": ..., "message": ...} on stdout.
//
//	gitops-health kstatus
//	    status.Compute of github.com/fluxcd/cli-utils pkg/kstatus/status: what Flux's
//	    kustomize-controller health checks (and `wait: true`) read.
//	gitops-health argocd-health SCRIPT.lua [--open-libs]
//	    Argo CD's health of a live resource (gitops-engine's health.GetResourceHealth, as the
//	    application controller calls it) with the script as the health override of the object's
//	    group and kind, run by Argo CD's util/lua. Without --open-libs, Lua's string and math
//	    libraries (and all but base, table, package and a safe os) stay closed, as for a script from
//	    argocd-cm without resource.customizations.useOpenLibs.<group>_<kind>: "true"; --open-libs
//	    is how Argo CD runs its built-in scripts and their tests (TestLuaHealthScript).
//
// A script error, an object that is not JSON or a bad command line exit 1 with the reason on
// stderr.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/argoproj/argo-cd/v3/pkg/apis/application/v1alpha1"
	argolua "github.com/argoproj/argo-cd/v3/util/lua"
	"github.com/argoproj/gitops-engine/pkg/health"
	"github.com/fluxcd/cli-utils/pkg/kstatus/status"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

const usage = "usage: gitops-health kstatus | gitops-health argocd-health SCRIPT.lua [--open-libs]  (the object as JSON on stdin)"

type verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	v, err := run(os.Args[1:], os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gitops-health:", err)
		os.Exit(1)
	}
	if err := json.NewEncoder(os.Stdout).Encode(v); err != nil {
		fmt.Fprintln(os.Stderr, "gitops-health:", err)
		os.Exit(1)
	}
}

func run(args []string, stdin io.Reader) (verdict, error) {
	if len(args) == 0 {
		return verdict{}, errors.New(usage)
	}
	switch command := args[0]; {
	case command == "kstatus" && len(args) == 1:
		obj, err := readObject(stdin)
		if err != nil {
			return verdict{}, err
		}
		return kstatus(obj)
	case command == "argocd-health" && (len(args) == 2 || len(args) == 3 && args[2] == "--open-libs"):
		script, err := os.ReadFile(args[1])
		if err != nil {
			return verdict{}, err
		}
		obj, err := readObject(stdin)
		if err != nil {
			return verdict{}, err
		}
		return argocdHealth(obj, string(script), len(args) == 3)
	default:
		return verdict{}, errors.New(usage)
	}
}

func readObject(stdin io.Reader) (*unstructured.Unstructured, error) {
	data, err := io.ReadAll(stdin)
	if err != nil {
		return nil, fmt.Errorf("reading the object: %w", err)
	}
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(data); err != nil {
		return nil, fmt.Errorf("the object on stdin: %w", err)
	}
	return obj, nil
}

func kstatus(obj *unstructured.Unstructured) (verdict, error) {
	result, err := status.Compute(obj)
	if err != nil {
		return verdict{}, fmt.Errorf("kstatus: %w", err)
	}
	return verdict{Status: result.Status.String(), Message: result.Message}, nil
}

// argocdHealth is what Argo CD's application controller does for a live resource
// (controller/health.go: health.GetResourceHealth(live, lua.ResourceHealthOverrides(overrides))):
// an object being deleted is "Progressing: Pending deletion" before any script runs; otherwise the
// override of the key "<group>/<Kind>", which is what argocd-cm's
// resource.customizations.health.<group>_<Kind> (and useOpenLibs) become, runs in util/lua.
func argocdHealth(obj *unstructured.Unstructured, script string, openLibs bool) (verdict, error) {
	overrides := argolua.ResourceHealthOverrides{
		argolua.GetConfigMapKey(obj.GroupVersionKind()): v1alpha1.ResourceOverride{
			HealthLua:   script,
			UseOpenLibs: openLibs,
		},
	}
	// On a script error Argo CD shows "Unknown" with the error as the message; a harness fails.
	result, err := health.GetResourceHealth(obj, overrides)
	if err != nil {
		return verdict{}, fmt.Errorf("argocd health (Argo CD shows Unknown): %w", err)
	}
	if result == nil {
		return verdict{}, errors.New("argocd health: no health script for the object's group and kind")
	}
	return verdict{Status: string(result.Status), Message: result.Message}, nil
}
