"""``fleetpilot engine --backend vllm``: check the planned settings, then exec ``vllm serve``.

The settings come from the same place as the planner's: an InferenceService file (``-f``,
``--tier``, ``--role``) or the JSON of an :class:`EngineLaunch`. The command is built by the
same function the planner uses, so a pod running the stock vLLM image with the planned command
and a pod running this launcher start the same engine. What the launcher adds is a look at the
machine before a multi-minute model load: too few visible GPUs or a missing model directory
fail at once with a message, instead of deep inside vLLM's start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, NoReturn

from fleetpilot.api import InvalidManifestError, RoleName, load_services
from fleetpilot.api.spec import EngineBackend
from fleetpilot.engine.vllm_args import (
    RUNTIME_LORA_ENV,
    EngineLaunch,
    EplbLaunch,
    LoraLaunch,
    SpeculativeLaunch,
    launch_for,
    vllm_serve_args,
)


class LaunchError(ValueError):
    """Settings that cannot start an engine on this machine."""


def launch_from_json(text: str) -> EngineLaunch:
    """An :class:`EngineLaunch` from its JSON form (unknown keys refused)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LaunchError(f"--launch-json is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise LaunchError("--launch-json must be a JSON object")
    known = {f.name for f in fields(EngineLaunch)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise LaunchError(f"--launch-json has unknown keys: {', '.join(unknown)}")
    try:
        if isinstance(data.get("speculative"), dict):
            data["speculative"] = SpeculativeLaunch(**data["speculative"])
        if isinstance(data.get("eplb"), dict):
            data["eplb"] = EplbLaunch(**data["eplb"])
        if isinstance(data.get("lora"), dict):
            lora = dict(data["lora"])
            lora["modules"] = tuple((name, path) for name, path in lora.get("modules", ()))
            data["lora"] = LoraLaunch(**lora)
    except (TypeError, ValueError) as exc:
        raise LaunchError(f"--launch-json: {exc}") from None
    if "extra_args" in data:
        data["extra_args"] = tuple(data["extra_args"])
    if "role" in data:
        try:
            data["role"] = RoleName(data["role"])
        except ValueError:
            choices = ", ".join(r.value for r in RoleName)
            raise LaunchError(f"--launch-json role must be one of {choices}") from None
    try:
        return EngineLaunch(**data)
    except TypeError as exc:
        raise LaunchError(f"--launch-json: {exc}") from None


def launch_to_json(launch: EngineLaunch) -> str:
    return json.dumps(asdict(launch), sort_keys=True)


def launch_from_file(path: Path, tier_name: str, role: str) -> EngineLaunch:
    """The launch of one role of one tier of the (single) service in ``path``."""
    services = load_services(path)
    if len(services) != 1:
        raise LaunchError(f"{path} holds {len(services)} services; give a file with one")
    tiers = {t.name: t for t in services[0].spec.tiers}
    if tier_name not in tiers:
        raise LaunchError(f"no tier {tier_name!r} in {path} (tiers: {', '.join(tiers)})")
    tier = tiers[tier_name]
    if tier.engine.backend is not EngineBackend.VLLM:
        raise LaunchError(
            f"tier {tier_name!r} runs engine.backend {tier.engine.backend.value}, not vLLM; "
            "`fleetpilot plan -o summary` shows its engine command"
        )
    resolved = tier.role(role)
    if resolved is None:
        roles = ", ".join(tier.role_names)
        raise LaunchError(f"tier {tier_name!r} has no role {role!r} (roles: {roles})")
    return launch_for(resolved)


def visible_gpus(environ: Mapping[str, str]) -> int | None:
    """GPUs this process may use, from the device plugin's CUDA_VISIBLE_DEVICES.

    None when it cannot be told (no variable), so the check is skipped rather than guessed.
    """
    devices = environ.get("CUDA_VISIBLE_DEVICES")
    if devices is not None:
        return len([d for d in devices.split(",") if d.strip() and d.strip() != "-1"])
    return None


def check_launch(
    launch: EngineLaunch, *, gpus: int | None, path_exists: Any = os.path.exists
) -> None:
    """Refuse settings that would fail only after vLLM spent minutes loading. Pure."""
    # One pod's share of a replica that spans nodes.
    needed = launch.tensor * launch.pipeline * launch.data // launch.nodes
    if gpus is not None and needed > gpus:
        nodes = f" / {launch.nodes} nodes" if launch.nodes > 1 else ""
        raise LaunchError(
            f"needs {needed} GPUs (tensor {launch.tensor} x pipeline {launch.pipeline} x "
            f"data {launch.data}{nodes}) but {gpus} are visible"
        )
    if launch.model.startswith("/") and not path_exists(launch.model):
        raise LaunchError(f"model directory {launch.model} does not exist (is the volume mounted?)")
    if not 1 <= launch.port <= 65535:
        raise LaunchError(f"port {launch.port} is out of range")
    if launch.role not in set(RoleName):
        raise LaunchError(f"role {launch.role!r} is not one of {', '.join(RoleName)}")
    if (launch.role is RoleName.UNIFIED) != (launch.kv_connector is None):
        raise LaunchError(
            "a KV connector is used by the prefill and decode roles, and only by them"
        )
    if launch.speculative is not None and launch.speculative.num_tokens < 1:
        raise LaunchError("speculative num_tokens must be at least 1")


GROUP_ENV = re.compile(r"\$\((LWS_[A-Z_]+)\)")


def expand_group_env(command: list[str], environ: Mapping[str, str]) -> list[str]:
    """``$(LWS_...)`` in the command replaced by the variables the LeaderWorkerSet controller
    sets, as the kubelet does for a container's args (the planned pods run ``vllm serve``
    directly and get this from the kubelet; the launcher execs it, so it does it itself)."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise LaunchError(
                f"{name} is not set: a replica that spans nodes runs in a LeaderWorkerSet "
                "group, whose controller sets it"
            )
        return environ[name]

    return [GROUP_ENV.sub(value, arg) for arg in command]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("-f", "--file", type=Path, help="InferenceService YAML file")
    source.add_argument("--launch-json", help="engine settings as JSON (what the planner computed)")
    parser.add_argument("--tier", help="tier to launch (with -f)")
    parser.add_argument(
        "--role", default=RoleName.UNIFIED.value, choices=list(RoleName), help="with -f"
    )
    parser.add_argument(
        "--worker",
        action="store_true",
        help="a worker of a replica that spans nodes (vllm serve --headless), not its leader",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the vllm command instead of running it"
    )


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    try:
        if args.file is not None:
            if not args.tier:
                raise LaunchError("--tier is required with -f")
            launch = launch_from_file(args.file, args.tier, args.role)
        else:
            launch = launch_from_json(args.launch_json)
        if args.worker and launch.nodes == 1:
            raise LaunchError("--worker is for a replica that spans nodes; this one fits on one")
        command = ["vllm", "serve", *vllm_serve_args(launch, worker=args.worker)]
        if args.dry_run:
            print(shlex.join(command))
            return 0
        check_launch(launch, gpus=visible_gpus(environ))
        command = expand_group_env(command, environ)
    except (LaunchError, InvalidManifestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    executable = shutil.which("vllm")
    if executable is None:
        print("error: vllm is not installed in this image (pip install vllm)", file=sys.stderr)
        return 2
    env = dict(environ)
    if launch.lora is not None and launch.lora.runtime_updates:
        env[RUNTIME_LORA_ENV] = "True"  # the load/unload endpoints the operator calls
    return _exec(executable, command, env)


def _exec(executable: str, command: list[str], env: Mapping[str, str]) -> NoReturn:
    sys.stdout.flush()
    # Replaces this process, so vLLM receives the pod's signals directly (graceful drain).
    os.execve(executable, command, env)
