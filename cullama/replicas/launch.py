"""`cullama serve --replicas N`'s process: check, listen, start or join a Ray cluster, deploy, relay, stop.

The order, and what a user sees:
1. The options and the model, checked as `cullama serve` checks them (server/launch.py prepare: a bad one is one line
   and exit 2, before anything starts); then the port listens (one in use: one line, exit 2, no Ray), and the relay
   answers at once: /health and every request 503 (no_replica) until a replica is ready.
2. The cluster: a new local one (`address="local"`: never a stale one a dead `ray start` left named in /tmp/ray), on
   loopback, or the one at --ray-address (`ray start --head` / `ray start --address` set it up across machines).
   Ray Serve runs in direct-ingress mode (each replica serves its app on a port of its own; Serve's own proxy then
   runs too, unused, on a free port) with a 1 s draining period (Serve's 30 s default makes every shutdown that long).
3. The replicas' resources, checked against the cluster's (Serve would wait for ever for a GPU the cluster lacks):
   one GPU each with --device cuda, or auto where the cluster has GPUs; else one CPU each.
4. The deployment (app.py), watched until it runs (every replica loaded), fails (the loader's one line and its exit
   code: a bad checkpoint, a KV cache that does not fit) or a signal comes. The relay takes each replica as soon as
   it runs, and the replicas Serve runs from then on (replacements, scaling), every REFRESH_S.
5. SIGINT or SIGTERM, from the start on: the relay stops accepting connections, every replica's engine stops (the
   Control actor: queued requests 503, running streams ended at their next token with the shutdown error event, as
   one `cullama serve`), the connections still open after --shutdown-grace seconds are closed, the application is
   deleted (a joined cluster: only ours) or Serve and the local cluster shut down, and the process exits 0, leaving
   no Ray process of its own (each step bounded: TEARDOWN_S).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import socket
import sys
import threading
import time

import ray
from ray import serve

from ..common.errors import CullamaError, OptionError
from ..server import SHUTDOWN_GRACE_S
from ..server.launch import is_loopback, listen, prepare, url
from .app import Control, ReplicaSpec, Scaling, build, load_failure
from .front import Front
from .relay import Relay, Target

REFRESH_S = 0.25  # seconds between two reads of the replicas Serve runs
PROGRESS_S = 30.0  # seconds between two "still starting" lines while the replicas load
TEARDOWN_S = 30.0  # the most each of: deleting the application, shutting Serve down
STOP_TIMEOUT_S = 5.0  # the most the replicas' engines take to hear the stop
# Serve's direct ingress, read by the controller and each replica process at import: their environment (a local
# cluster inherits this process's; a joined one gets them through runtime_env). The replica's app runs on the loop of
# the replica's own HTTP server, not on a thread of its own: one hop less for every streamed chunk (the gaps between
# tokens at a replica's port went from 1.10x to 1.00x a single server's on the CPU here; the app never blocks its loop:
# the engine has its thread, prompts are tokenized on worker threads).
INGRESS_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
               "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
APP_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class RayError(CullamaError):
    """The cluster cannot serve the replicas: too few GPUs or CPUs, an application of that name already there,
    Serve running without direct ingress."""


def serve_replicas(model_dir: str, scaling: Scaling, host: str = "127.0.0.1", port: int = 8000,
                   device: str = "auto", max_queue: int = 64, shutdown_grace: float = SHUTDOWN_GRACE_S,
                   ray_address: str | None = None, ray_app: str = "cullama", replica_cpus: float = 1.0,
                   revision: str | None = None, **serve_options) -> int:
    """Serve `model_dir` (a directory, or a hub id at `revision`) from replicas on a Ray cluster (a local one, or the
    one at `ray_address`) behind `host`:`port` until SIGINT or SIGTERM; the exit status. replica_cpus: the CPUs Ray
    reserves for each replica (its engine thread and HTTP; a GPU replica also reserves one GPU). serve_options:
    prepare()'s (max_batch, api_key, allowed_hosts, speculative, ...)."""
    scaling.check()
    if not APP_NAME.match(ray_app):
        raise OptionError("ray_app", f"must be 1 to 64 letters, digits, - or _, got {ray_app!r}")
    settings, load = prepare(model_dir, device=device, revision=revision, **serve_options)
    from ..model import hub

    if hub.is_hub_id(model_dir):  # each replica reads it from its own machine's hub cache
        load.update(path=model_dir, revision=revision)
    stopping = Stopping()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, stopping.on_signal)
        signal.signal(signal.SIGTERM, stopping.on_signal)

    sock = listen(host, port)
    if not settings.api_key and not is_loopback(host):
        print(f"warning: cullama serve listens on {host} without an API key: anyone who can reach this port "
              "can use the model (set --api-key or CULLAMA_API_KEY)", file=sys.stderr)
    settings = dataclasses.replace(settings, hosts=(host, sock.getsockname()[0], *settings.hosts))
    relay = Relay(f"/{ray_app}")
    front = Front(relay, shutdown_grace)
    relaying = threading.Thread(target=front.run, args=(sock,), name="cullama-relay", daemon=True)
    relaying.start()
    low, high = scaling.bounds
    count = f"{low}" if low == high else f"{low} to {high}"
    print(f"cullama serve: listening on {url(sock)} (model {settings.model_name}; starting {count} replicas on Ray)",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    status, cluster = 0, None
    try:
        cluster = Cluster(ray_address, ray_app, keyed=settings.api_key is not None)
        if not cluster.start(stopping):
            return 0
        load["device"] = cluster.device_for(device, low, high, replica_cpus)
        spec = ReplicaSpec(load, settings, max_queue, ray_app)
        status = cluster.deploy(spec, scaling, relay, stopping, replica_cpus)
        if status or stopping.is_set():
            return status
        print(f"cullama serve: {len(relay.targets)} replica{'s' if len(relay.targets) > 1 else ''} of "
              f"{settings.model_name} ready on {load['device']} in {time.monotonic() - started:.1f} s (Ray cluster "
              f"{cluster.address}{', started here' if not ray_address else ''}; its logs: {cluster.logs})",
              file=sys.stderr, flush=True)
        while not stopping.wait(REFRESH_S):
            cluster.refresh(relay)
        return 0
    except CullamaError as exc:
        print(f"error: {exc.for_cli()}", file=sys.stderr, flush=True)
        status = exc.exit_code
        return status
    finally:
        front.stop()  # no new connections; the open ones end with the engines, or in shutdown_grace
        if cluster is not None:
            cluster.stop_engines()
        relaying.join(shutdown_grace + 5)
        sock.close()
        if cluster is not None:
            cluster.teardown()


class Stopping:
    """Whether SIGINT or SIGTERM came. A flag, not a threading.Event: the handler runs on the main thread, maybe
    while it holds the Event's own lock inside Event.wait, and Event.set would then wait for ever."""

    def __init__(self):
        self.stop = False

    def on_signal(self, signum, frame) -> None:
        self.stop = True

    def is_set(self) -> bool:
        return self.stop

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds` (unless a signal came); whether a signal came."""
        if not self.stop:
            time.sleep(seconds)
        return self.stop


class Cluster:
    """The Ray cluster and our application on it (the Ray calls of serve_replicas, in order)."""

    def __init__(self, address: str | None, app: str, keyed: bool):
        self.joined, self.app, self.keyed = address is not None, app, keyed
        self.address = address or "local"
        self.control = self.controller = None
        self.deployed = False
        self.logs = "?"

    def start(self, stopping: Stopping) -> bool:
        """ray.init and Serve; False where a signal came first."""
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a server of yours does not report to Anyscale
        if not self.joined:
            os.environ.update(INGRESS_ENV)  # the local cluster's processes inherit them
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        try:
            context = ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                               logging_level=logging.WARNING,
                               **({} if self.joined else {"_node_ip_address": "127.0.0.1"}))
        except SystemExit:  # Ray's SIGTERM handler while it connects: a clean stop
            ray.shutdown()
            return False
        except ConnectionError as exc:
            raise RayError(f"cannot join the Ray cluster at {self.address}: {exc}") from None
        finally:
            if threading.current_thread() is threading.main_thread():  # ray.init put its own SIGTERM handler
                signal.signal(signal.SIGTERM, stopping.on_signal)
        self.address = context.address_info.get("gcs_address", self.address)
        self.logs = os.path.join(context.address_info.get("session_dir", "?"), "logs")
        if stopping.is_set():
            return False
        if self.app in serve.status().applications:
            raise RayError(f"the Ray cluster at {self.address} already runs an application named {self.app} (another "
                           f"`cullama serve --replicas`, or one left by a process that was killed: `serve delete "
                           f"{self.app}` removes it); name ours with --ray-app")
        serve.start(http_options={"host": self.replica_host(), "port": free_port()},
                    proxy_location="HeadOnly",
                    controller_options={"runtime_env": {"env_vars": INGRESS_ENV}} if self.joined else None)
        from ray.serve.context import _get_global_client

        self.controller = _get_global_client()._controller  # for the replicas' ports (refresh)
        self.here = ray.util.get_node_ip_address()  # this machine's replicas are reached on loopback
        return True

    def replica_host(self) -> str:
        """Where the replicas listen: loopback on a cluster of this machine alone, else every interface (the relay
        reaches the replicas of the other machines), with a warning where no API key guards them."""
        here = ray.util.get_node_ip_address()
        if not self.joined or all(node["NodeManagerAddress"] == here for node in ray.nodes() if node["Alive"]):
            return "127.0.0.1"
        if not self.keyed:
            print("warning: the replicas listen on every interface of their machines (Ray Serve's ports 30000 to "
                  "31000) without an API key: anyone who can reach them can use the model (set --api-key)",
                  file=sys.stderr)
        return "0.0.0.0"

    def device_for(self, device: str, low: int, high: int, cpus_each: float) -> str:
        """The replicas' device: cuda (one GPU each) or cpu, where the cluster has room for `low` of them (RayError
        otherwise: Serve would wait for ever); a note where it has none for `high`, or not now for `low` (the
        resources other applications hold: Serve waits until they are free)."""
        total, free = ray.cluster_resources(), ray.available_resources()
        if device == "auto":
            device = "cuda" if total.get("GPU", 0) >= 1 else "cpu"
        needs = {"GPU": 1.0, "CPU": cpus_each} if device == "cuda" else {"CPU": cpus_each}
        for what, each in needs.items():
            if not each:
                continue
            have = total.get(what, 0.0)
            fits = int(have // each + 1e-9)
            if fits < low:
                hint = ": give --device cpu, or join a cluster with GPUs (--ray-address)" if what == "GPU" else ""
                raise RayError(f"the Ray cluster at {self.address} has {have:g} {what}{'s' if have != 1 else ''}, and "
                               f"{low} replica{'s' if low > 1 else ''} on {device} need{'s' if low == 1 else ''} "
                               f"{low * each:g}{hint}")
            if fits < high:
                print(f"note: the Ray cluster has {have:g} {what}s: at most {fits} of the {high} replicas can run",
                      file=sys.stderr)
            if free.get(what, 0.0) + 1e-9 < low * each:
                print(f"note: {free.get(what, 0.0):g} of the Ray cluster's {have:g} {what}s are free now (other "
                      f"applications hold the rest): the replicas wait for them", file=sys.stderr, flush=True)
        return device

    def deploy(self, spec: ReplicaSpec, scaling: Scaling, relay: Relay, stopping: Stopping, cpus_each: float) -> int:
        """Deploy and wait until the application runs (0), fails (the loader's exit code, its line printed) or a
        signal comes (0); the relay takes the replicas as they come."""
        self.control = Control.remote()
        application = build(spec, scaling, self.control, cpus_each, INGRESS_ENV if self.joined else None)
        serve.run_many([serve.RunTarget(application, name=self.app, route_prefix=f"/{self.app}")],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        self.deployed = True
        said = time.monotonic()
        while not stopping.wait(REFRESH_S):
            state = serve.status().applications.get(self.app)
            self.refresh(relay)
            if state is None:
                continue
            if state.status == "DEPLOY_FAILED":  # (UNHEALTHY while starting: Serve retries the replica)
                messages = [state.message, *(d.message for d in state.deployments.values())]
                line, code = next(filter(None, map(load_failure, messages)), None) or (
                    f"error: the deployment failed: {' '.join(m for m in messages if m)[:2000]}", 1)
                print(line, file=sys.stderr, flush=True)
                return code
            if state.status == "RUNNING":
                if not relay.targets:  # the replicas run, and none is reached on a port of its own
                    raise RayError(f"the Ray cluster at {self.address} runs Ray Serve without direct ingress (it was "
                                   "started before, otherwise): shut it down (`serve shutdown`), or start it with "
                                   "RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in its environment")
                return 0
            if time.monotonic() - said > PROGRESS_S:
                said = time.monotonic()
                waiting = " ".join(d.message for d in state.deployments.values() if d.message)
                print(f"cullama serve: still starting the replicas{': ' + waiting if waiting else ''}",
                      file=sys.stderr, flush=True)
        return 0

    def refresh(self, relay: Relay) -> None:
        """The replicas Serve runs now, into the relay (the last list kept while the controller does not answer)."""
        try:
            relay.set_targets(replica_targets(self.controller, self.app, self.here))
        except Exception as exc:  # noqa: BLE001 - the controller restarting, say: the relay keeps its list
            print(f"cullama serve: could not read the replicas ({type(exc).__name__}); retrying", file=sys.stderr)

    def stop_engines(self) -> None:
        """Every replica's engine stops as one `cullama serve`'s does on a signal (the Control actor)."""
        if self.control is None:
            return
        try:
            ray.get(self.control.stop.remote(), timeout=STOP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - Serve's own draining stops them next
            print(f"cullama serve: could not tell the replicas to stop ({type(exc).__name__})", file=sys.stderr)

    def teardown(self) -> None:
        """Our application gone (a joined cluster keeps running), or Serve and the local cluster shut down."""
        if ray.is_initialized():
            if self.deployed or not self.joined:
                bounded(lambda: serve.delete(self.app) if self.joined else serve.shutdown(), TEARDOWN_S,
                        "deleting the application" if self.joined else "shutting Serve down")
            ray.shutdown()


def replica_targets(controller, app: str, here: str) -> list[Target]:
    """The application's running replicas and their ports, from Serve's controller: get_target_groups is a private
    method (the one Serve's HAProxy mode reads), hence the pin of ray to 2.60.x; tests/replicas cover it. Before any
    replica runs, Serve answers with its own proxy: only replicas are taken. A replica on this machine (its node's
    address `here`) is reached on loopback, where it listens on a cluster of this machine alone."""
    groups = ray.get(controller.get_target_groups.remote(app, True), timeout=5)
    return [Target(t.name.rsplit("#", 1)[-1], "127.0.0.1" if t.ip == here else t.ip, t.port) for g in groups
            if g.app_name == app and getattr(g.protocol, "value", g.protocol) == "HTTP"
            for t in g.targets if t.name.startswith("SERVE_REPLICA::")]


def bounded(step, timeout: float, what: str) -> None:
    """Run `step` for at most `timeout` seconds (on a thread left behind past it, with a line saying so)."""
    errors: list[BaseException] = []

    def run():
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - said below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        print(f"cullama serve: {what} took more than {timeout:g} s; going on", file=sys.stderr)
    elif errors:
        print(f"cullama serve: {what} failed ({type(errors[0]).__name__}: {errors[0]})", file=sys.stderr)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on this machine (Serve's own, unused, proxy: it binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

