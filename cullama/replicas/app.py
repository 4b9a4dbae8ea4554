"""The Ray Serve application of `cullama serve`: one deployment whose replica owns one model on one GPU (or the CPU) and
serves the very app `cullama serve` serves (server/app.py's create_app: the OpenAI routes, the API key, the Host and
Origin checks, the limits and every error), built once its engine has loaded the model.

    serve run cullama.replicas.app:build_app model=DIR device=cpu replicas=2      # Ray's own proxy in front
    serve.run(cullama.replicas.app.application("DIR", replicas=2), name=..., route_prefix=...)

`cullama serve --replicas N` (launch.py) deploys the same application with a Control actor of its own and its relay
in front (relay.py). A replica:
- loads the model in its constructor, on the engine thread, and only then takes traffic (Serve sends none before the
  constructor returns); a model that fails to load fails the replica with the loader's one line (LoadFailed), and
  max_constructor_retry_count=1 fails the deployment rather than loading it again and again;
- takes up to max_batch + max_queue requests (the engine answers 429 past them) plus ROUTE_HEADROOM for /health and
  /metrics: `max_ongoing_requests`;
- is healthy while its engine serves (Engine.problem(): a dead engine thread makes it unhealthy, and Serve replaces
  it), or while it stops on purpose;
- stops its engine (the queue answered 503, the running generations ended at their next token, their streams with
  the shutdown error event, as `cullama serve` does on a signal) when the Control actor says so, or when the Control
  actor dies with the process that owns it (then it also asks Serve to delete its application: a `cullama serve
  --replicas` killed outright leaves no replica holding a GPU on a cluster it joined).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import sys
from typing import Any

import ray
from ray import serve

from ..common.errors import CullamaError, OptionError
from ..server.app import Settings, create_app
from ..server.engine import Engine
from ..server.metrics import Metrics
from . import DEPLOYMENT

ROUTE_HEADROOM = 4  # ongoing requests a replica takes beyond its engine's, for /health, /metrics and /v1/models
# Seconds Serve gives a replica it stops (scaling down, a redeploy) to finish its requests before it is killed: a
# generation of a few thousand tokens at tens of ms each. `cullama serve --replicas` stops the engines itself first,
# so its shutdown does not wait this long.
DRAIN_S = 60.0
HEALTH_PERIOD_S, HEALTH_TIMEOUT_S = 2.0, 10.0  # Serve's health checks (check_health) of each replica


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How many replicas: a fixed number, or autoscaling between min_replicas and max_replicas on the requests each
    replica holds (target: its --max-batch; past it requests wait in its queue), averaged over `window` seconds, up
    after `upscale_delay` seconds of more, down after `downscale_delay` seconds of fewer."""

    replicas: int = 1
    min_replicas: int | None = None  # autoscaling when min_replicas or max_replicas is given
    max_replicas: int | None = None
    upscale_delay: float = 30.0  # Serve's defaults
    downscale_delay: float = 600.0
    window: float = 10.0

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """(the replicas deployed at first, the most there may be)."""
        if not self.autoscaling:
            return self.replicas, self.replicas
        low = 1 if self.min_replicas is None else self.min_replicas
        high = max(low, 1) if self.max_replicas is None else self.max_replicas
        return low, high

    def check(self) -> "Scaling":
        """Itself, or OptionError naming the option at fault."""
        if self.replicas < 1:
            raise OptionError("replicas", f"must be at least 1, got {self.replicas}")
        low, high = self.bounds
        if self.autoscaling and not 1 <= low <= high:  # no scaling to zero: a replica loads for seconds to minutes
            raise OptionError("min_replicas", f"and --max-replicas must satisfy 1 <= min <= max (got {low} and "
                                              f"{high})")
        for name in ("upscale_delay", "downscale_delay", "window"):
            if not getattr(self, name) > 0:
                raise OptionError(name, f"must be more than 0 seconds, got {getattr(self, name)}")
        return self


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What every replica needs (it travels to each, pickled): Llama.from_pretrained's keywords (server/launch.py's
    prepare: `device` is "cuda" or "cpu" here, as the replica's resources say), the app's Settings, the engine's
    limits."""

    load: dict
    settings: Settings
    max_queue: int = 64
    app_name: str = "cullama"  # the Serve application (a replica whose owner is gone deletes it)

    @property
    def max_batch(self) -> int:
        return self.load["max_batch"]

    @property
    def num_gpus(self) -> int:
        return 1 if self.load["device"] == "cuda" else 0


class LoadFailed(RuntimeError):
    """A replica's model failed to load. Serve keeps only the text of the constructor's traceback, so the exit code
    travels inside the message: `[exit 2] error: <the loader's one line>` (load_failure reads it back)."""

    def __init__(self, line: str, exit_code: int):
        super().__init__(f"[exit {exit_code}] {line}")
        self.line, self.exit_code = line, exit_code

    def __reduce__(self):
        return LoadFailed, (self.line, self.exit_code)


LOAD_FAILED = re.compile(r"LoadFailed: \[exit (\d+)\] (.*)")


def load_failure(text: str) -> tuple[str, int] | None:
    """(the loader's line, its exit code) where `text` (a deployment's status message) holds a LoadFailed."""
    found = LOAD_FAILED.findall(text)
    return (found[-1][1].strip(), int(found[-1][0])) if found else None


class ReplicaMetrics(Metrics):
    """The server's metrics, plus a cullama_replica_info series naming this replica's process and node (which
    /metrics/replicas labels with the replica's id: where to look for its logs, or to profile it)."""

    def __init__(self, pid: int, node: str):
        super().__init__()
        self.info = (f"# HELP cullama_replica_info The replica's process and node.\n"
                     f"# TYPE cullama_replica_info gauge\n"
                     f'cullama_replica_info{{pid="{pid}",node="{node}"}} 1\n')

    def render(self) -> str:
        return super().render() + self.info


class ReplicaApp:
    """Pure ASGI (a BaseHTTPMiddleware would wrap every streamed chunk): the app sees the request as `cullama serve`
    would, its path without the application's route prefix (which Serve leaves in the path and puts in root_path:
    the API key and the routes are checked on the path), and every answer names the replica in `x-cullama-replica`."""

    def __init__(self, app, replica: str):
        self.app, self.tag = app, [(b"x-cullama-replica", replica.encode())]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        prefix = scope.get("root_path", "")
        if prefix and scope["path"].startswith(prefix):
            path = scope["path"][len(prefix):] or "/"
            scope = {**scope, "path": path, "raw_path": path.encode(), "root_path": ""}

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.tag]}
            await send(message)

        await self.app(scope, receive, tagged)


@serve.deployment(name=DEPLOYMENT)
@serve.ingress()
class Replica:
    async def __init__(self, spec: ReplicaSpec, control=None):
        # async: the constructor runs on the replica's event loop, which keeps answering Ray while the weights load
        from ..llama import Llama

        context = serve.get_replica_context()
        self.spec, self.replica_id = spec, context.replica_id.unique_id
        self.stopping = False
        self.metrics = ReplicaMetrics(os.getpid(), _node_ip())

        def load():
            llm = Llama.from_pretrained(**spec.load)
            print(f"cullama serve: replica {self.replica_id} (pid {os.getpid()}) is ready on {llm.device}",
                  file=sys.stderr, flush=True)
            return llm

        self.engine = Engine(load, spec.max_queue, self.metrics, spec.max_batch)
        self.engine.start()
        while self.engine.state == "loading":
            await asyncio.sleep(0.02)
        if self.engine.state == "failed":
            exc = self.engine.load_error
            if isinstance(exc, CullamaError):
                raise LoadFailed(f"error: {exc.for_cli()}", exc.exit_code) from None
            raise LoadFailed(f"error: the model failed to load: {type(exc).__name__}: {exc}", 1) from None
        self._watch = None if control is None else asyncio.ensure_future(self._stop_when_told(control))

    def __serve_build_asgi_app__(self):
        return ReplicaApp(create_app(self.engine, self.spec.settings, self.metrics), self.replica_id)

    async def _stop_when_told(self, control) -> None:
        try:
            await control.wait_stop.remote()
            orphaned = False
        except Exception:  # the Control actor died: the process that deployed this application is gone
            orphaned = True
        self.stopping = True
        self.engine.stop()
        if orphaned:
            print(f"cullama serve: replica {self.replica_id}: the `cullama serve --replicas` that deployed "
                  f"{self.spec.app_name} is gone; deleting the application", file=sys.stderr, flush=True)
            await asyncio.to_thread(_delete_app, self.spec.app_name)

    def check_health(self) -> None:
        """Serve's health check (every HEALTH_PERIOD_S): raises where the engine does not serve."""
        problem = self.engine.problem()
        if problem is not None and not self.stopping:
            raise RuntimeError(problem)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            self.stopping = True
            engine.stop()  # the queue answered 503, the running generations end at their next token
            engine.join(timeout=10)


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


def _delete_app(name: str) -> None:
    try:
        serve.delete(name, _blocking=False)
    except Exception as exc:  # the controller gone too (the cluster going away): nothing left to delete
        print(f"cullama serve: could not delete {name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


@ray.remote(num_cpus=0)
class Control:
    """The word of `cullama serve --replicas` to every replica at once: each replica awaits wait_stop() from the
    moment it is ready (a replacement too: it gets the same handle), and stop() returns them all. An actor owned by the
    process that made it, so it dies with it (and each replica hears that as an error of wait_stop()). A Serve
    user_config cannot do this in Ray 2.60: a redeploy is a new version of the code, whose replicas replace the old
    ones (cutting their streams) rather than being told."""

    def __init__(self):
        self.stopped = asyncio.Event()

    async def wait_stop(self) -> bool:
        await self.stopped.wait()
        return True

    def stop(self) -> None:
        self.stopped.set()


def deployment_options(spec: ReplicaSpec, scaling: Scaling, num_cpus: float = 1.0,
                       env_vars: dict | None = None) -> dict:
    """Serve's options of the deployment. env_vars: the replicas' environment (Serve's ingress mode, read by each
    replica process at import)."""
    actor: dict[str, Any] = {"num_gpus": spec.num_gpus, "num_cpus": num_cpus}
    if env_vars:
        actor["runtime_env"] = {"env_vars": dict(env_vars)}
    options: dict[str, Any] = dict(
        max_ongoing_requests=spec.max_batch + spec.max_queue + ROUTE_HEADROOM, ray_actor_options=actor,
        health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=HEALTH_TIMEOUT_S,
        graceful_shutdown_timeout_s=DRAIN_S, graceful_shutdown_wait_loop_s=0.5,
        max_constructor_retry_count=1)  # a model that fails to load fails the deployment, not 20 loads later
    if scaling.autoscaling:
        low, high = scaling.bounds
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high, "initial_replicas": low,
            # a replica is busy past its batch: requests then wait in its queue
            "target_ongoing_requests": spec.max_batch,
            "upscale_delay_s": scaling.upscale_delay, "downscale_delay_s": scaling.downscale_delay,
            "look_back_period_s": scaling.window,
            # how often each replica reports its ongoing requests: Serve 2.60's default (10 s) is too slow for
            # delays of seconds (the option is deprecated for environment variables that 2.60 does not read yet)
            "metrics_interval_s": max(0.2, min(1.0, scaling.window / 5)),
        }
    else:
        options["num_replicas"] = scaling.replicas
    return options


def build(spec: ReplicaSpec, scaling: Scaling, control=None, num_cpus: float = 1.0, env_vars: dict | None = None):
    """The application (serve.Application): `control`, the Control actor whose stop() stops every replica's
    engine (None: Serve's own draining stops them)."""
    import warnings

    with warnings.catch_warnings():  # metrics_interval_s: see deployment_options
        warnings.simplefilter("ignore", DeprecationWarning)
        return Replica.options(**deployment_options(spec, scaling, num_cpus, env_vars)).bind(spec, control)


def application(model: str, *, replicas: int = 1, min_replicas: int | None = None, max_replicas: int | None = None,
                upscale_delay: float = 30.0, downscale_delay: float = 600.0, window: float = 10.0,
                device: str = "auto", max_queue: int = 64, num_cpus: float = 1.0, app_name: str = "cullama",
                **serve_options):
    """The application of `model` (a checkpoint directory, or a hub id) for a Ray app of your own: checked here as
    `cullama serve` checks it (a bad option or model raises its CullamaError), served by each replica on one GPU
    (device "cuda"), or on the CPU (device "cpu"); "auto": a GPU where this process sees one. serve_options:
    server/launch.py prepare()'s (max_batch, api_key, allowed_hosts, max_seq_len, quantize, speculative...)."""
    from ..runtime.device import cuda_status
    from ..server.launch import prepare

    if device not in ("auto", "cpu", "cuda"):
        raise OptionError("device", f"must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        device = "cuda" if cuda_status()[0] else "cpu"
    scaling = Scaling(replicas, min_replicas, max_replicas, upscale_delay, downscale_delay, window).check()
    settings, load = prepare(model, device=device, **serve_options)
    return build(ReplicaSpec(load, settings, max_queue, app_name), scaling, num_cpus=num_cpus)


def build_app(args: dict):
    """`serve run cullama.replicas.app:build_app model=DIR [device=cpu] [replicas=2] [max_batch=8] ...`: application()
    of serve run's key=value arguments (strings) or of a config file's (values as they are)."""
    import inspect

    from ..server.launch import prepare

    known = {**inspect.signature(application).parameters, **inspect.signature(prepare).parameters}
    known.pop("serve_options")
    kwargs = {}
    for key, value in args.items():
        name = {"model_dir": "model"}.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in known:
            raise OptionError(key, f"is not an argument of cullama.replicas.app:build_app (known: "
                                   f"{', '.join(sorted(k for k in known if k != 'model_dir'))})")
        kwargs[name] = _typed(name, value, known[name])
    if "model" not in kwargs:
        raise OptionError("model", "is needed: build_app model=DIR (or a hub id)")
    return application(**kwargs)


def _typed(name: str, value, parameter):
    """serve run's string `value` as the parameter's type (its default's; tuples: comma-separated)."""
    if not isinstance(value, str):
        return tuple(value) if isinstance(value, list) else value
    default = parameter.default
    annotation = str(parameter.annotation)
    try:
        if "tuple" in annotation:
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if "dict" in annotation:
            import json

            return json.loads(value)
        if isinstance(default, bool):
            return value.lower() in ("1", "true", "yes")
        if isinstance(default, int) or ("int" in annotation and "float" not in annotation):
            return int(value)
        if isinstance(default, float) or "float" in annotation:
            return float(value)
    except ValueError:
        raise OptionError(name, f"must be a number, got {value!r}") from None
    return value
