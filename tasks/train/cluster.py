"""Where training runs: one device, every local GPU, or several workers under ``TF_CONFIG``.

On a cluster the platform (a Kubernetes training job, Vertex AI, SageMaker, Ray Train) runs
the same train stage once per worker with ``TF_CONFIG`` set, and :func:`choose_strategy`
picks ``MultiWorkerMirroredStrategy`` from it. On one machine :func:`launch_local_workers`
plays the platform: it starts the workers on 127.0.0.1, each with its ``TF_CONFIG`` (ports
picked free), and collects their exit. The number of workers is ``SHARDFLOW_TRAIN_WORKERS``
(an environment variable, not a ``train.*`` param: where training runs does not change
what the stage is asked to compute, so it neither retrains nor changes the resume identity).
A worker waits at most ``cluster.join_timeout_s`` for the others to join the cluster and to
reach training (:func:`choose_strategy`, :func:`meet`): a chief that failed before training
leaves no worker waiting for good.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tensorflow as tf

WORKERS_ENV = "SHARDFLOW_TRAIN_WORKERS"
TF_CONFIG_ENV = "TF_CONFIG"
# After one worker dies, how long the others get to fail on their own (their collectives
# error out) before they are stopped: a dead worker fails the run, never hangs it.
DEAD_WORKER_GRACE_S = 20.0
# The exit status of a training process stopped by SIGTERM once it saved where it stood: the
# shell's for a process killed by SIGTERM (128 + 15), so a platform reads it as preempted.
EXIT_PREEMPTED = 128 + signal.SIGTERM


# -- a stop asked by SIGTERM ----------------------------------------------------------------


class Preempted(RuntimeError):
    """Training stopped on SIGTERM after saving where it stood (its epoch and step): a
    rerun resumes there. A process it ends exits with :data:`EXIT_PREEMPTED`."""

    exit_status = EXIT_PREEMPTED


_stop_asked = threading.Event()


def stop_asked() -> bool:
    """Whether training in this process was asked to stop (:func:`ask_stop`)."""
    return _stop_asked.is_set()


def ask_stop() -> None:
    """Ask the training under way in this process (or about to start) to save where it
    stands and stop: what a SIGTERM does, from a handler that is not
    :func:`stop_on_sigterm`'s (training in another thread than the main one)."""
    _stop_asked.set()


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Inside, SIGTERM only asks training to stop (:func:`stop_asked`): the step under way
    finishes and its state is saved before the process ends. The handler before is put
    back after, and the request is forgotten. Only the main thread can set a handler;
    elsewhere the process's own handler may call :func:`ask_stop`."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: ask_stop()) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        _stop_asked.clear()


# -- inside a worker -----------------------------------------------------------------------


def cluster_workers() -> int:
    """Workers named in ``TF_CONFIG`` (chief included); 0 without one."""
    config = json.loads(os.environ.get(TF_CONFIG_ENV) or "{}")
    cluster = config.get("cluster", {})
    return len(cluster.get("worker", [])) + len(cluster.get("chief", []))


def config_is_chief() -> bool:
    """Whether this process records the run: no ``TF_CONFIG``, or the chief of its cluster
    (the ``chief`` task, else worker 0). Read without TensorFlow."""
    config = json.loads(os.environ.get(TF_CONFIG_ENV) or "{}")
    task = config.get("task") or {}
    if not task:
        return True
    has_chief = bool(config.get("cluster", {}).get("chief"))
    return task.get("type") == "chief" or (
        task.get("type") == "worker" and int(task.get("index", 0)) == 0 and not has_chief
    )


class ClusterIncomplete(RuntimeError):
    """A worker of a multi-worker run did not see every worker join, or reach training,
    within ``cluster.join_timeout_s``, or lost one before training: it fails instead of
    waiting forever for a chief that failed or never started."""


def choose_strategy(join_timeout_s: float | None = None) -> tf.distribute.Strategy:
    """MultiWorkerMirroredStrategy under a ``TF_CONFIG`` cluster; else MirroredStrategy over
    every visible GPU when there is one; else the default strategy.

    With ``join_timeout_s`` (``cluster.join_timeout_s``) a worker whose cluster is not whole
    within it raises :class:`ClusterIncomplete`; None waits as long as TensorFlow does (a
    worker alone waited past two minutes here, with no end in sight).

    Call it before any other TensorFlow op: the multi-worker strategy configures the runtime.
    """
    import tensorflow as tf

    if cluster_workers() > 1:
        if join_timeout_s is None:
            return tf.distribute.MultiWorkerMirroredStrategy()
        _bound_the_join(join_timeout_s)
        try:
            return tf.distribute.MultiWorkerMirroredStrategy()
        except tf.errors.DeadlineExceededError as error:
            raise ClusterIncomplete(
                f"{_this_task()} waited {join_timeout_s:g} s (cluster.join_timeout_s) for "
                f"the workers of TF_CONFIG's cluster to join, and not all did: {_WHY}"
            ) from error
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return tf.distribute.MirroredStrategy([gpu.name for gpu in gpus])
    return tf.distribute.get_strategy()


# What keeps a worker's peers away, and what to do: said by every ClusterIncomplete.
_WHY = (
    "the chief failed or stalled before training, or never started (its log says why: a "
    "refusal, the tracking store, the workspace lock, `dvc repro` finding train up to date), "
    "or another worker never started. Fix that and start every worker again; raise "
    "cluster.join_timeout_s only if they take that long to start and reach training"
)


def _this_task() -> str:
    """This process's task in ``TF_CONFIG`` (``worker-1``), read without TensorFlow."""
    task = json.loads(os.environ.get(TF_CONFIG_ENV) or "{}").get("task") or {}
    return f"{task.get('type', 'worker')}-{task.get('index', 0)}"


def _bound_the_join(timeout_s: float) -> None:
    """Configure TensorFlow's coordination service as MultiWorkerMirroredStrategy does (it
    keeps a configuration it finds), with a bound on how long this task waits for every
    task of the cluster to register."""
    import tensorflow as tf
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    coordinated = ("chief", "worker")  # the strategy's coordinated jobs
    if resolver.task_type not in coordinated:
        return
    spec = resolver.cluster_spec()
    jobs = [job for job in coordinated if job in spec.jobs]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{jobs[0]}/replica:0/task:0",  # the chief, else worker 0
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
            for job in jobs
        ],
        cluster_register_timeout_in_ms=int(timeout_s * 1000),
    )


def meet(strategy: tf.distribute.Strategy, timeout_s: float | None) -> None:
    """Wait until every worker reaches this point, at most ``timeout_s`` (None: no bound):
    the run's first collective. A chief that failed or stalled before training (a gate
    refusal, the tracking store down) left the others in their first collective for good;
    they now raise :class:`ClusterIncomplete` naming why. Later collectives are not bounded:
    a step or the chief's validation takes what it takes."""
    import tensorflow as tf

    if num_workers(strategy) == 1:
        return
    one = strategy.experimental_distribute_values_from_function(lambda _: tf.constant(1.0))
    # Over the ring, with a timeout, as TensorFlow's own wait for a cluster's workers does.
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout_s,
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
    )
    try:
        strategy.extended.reduce_to(tf.distribute.ReduceOp.SUM, one, "/device:CPU:0", options)
    except tf.errors.DeadlineExceededError as error:
        raise ClusterIncomplete(
            f"{worker_name(strategy)} waited {timeout_s:g} s (cluster.join_timeout_s) for "
            f"every worker of its cluster to reach training, and not all did: {_WHY}"
        ) from error
    except tf.errors.UnavailableError as error:  # a peer's process ended (its socket closed)
        raise ClusterIncomplete(
            f"{worker_name(strategy)} lost a worker of its cluster before training "
            f"({error.message.splitlines()[0]}): {_WHY}"
        ) from error


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True for the worker that records outputs: the ``chief`` task, else worker 0."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return True
    if resolver.task_type == "chief":
        return True
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return resolver.task_type == "worker" and resolver.task_id == 0 and not has_chief


def worker_name(strategy: tf.distribute.Strategy) -> str:
    """This worker's cluster name (``worker-1``), ``worker`` outside a cluster."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return "worker"
    return f"{resolver.task_type}-{resolver.task_id}"


def strategy_name(strategy: tf.distribute.Strategy) -> str:
    """The strategy's public name (TensorFlow's multi-worker class is named otherwise)."""
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "MultiWorkerMirroredStrategy"
    return type(strategy).__name__


def num_workers(strategy: tf.distribute.Strategy) -> int:
    return int(getattr(strategy.extended, "_num_workers", 1) or 1)


def chief_value(strategy: tf.distribute.Strategy, value: float) -> float:
    """``value`` as the chief has it, on every worker.

    A collective: every worker calls it at the same point, so it doubles as a barrier.
    """
    import tensorflow as tf

    if strategy.num_replicas_in_sync == 1:
        return value
    own = value if is_chief(strategy) else 0.0

    def chief_replica_only(context: tf.distribute.InputReplicaContext) -> tf.Tensor:
        first = context.replica_id_in_sync_group == 0
        return tf.constant(own if first else 0.0, tf.float64)

    per_replica = strategy.experimental_distribute_values_from_function(chief_replica_only)
    return float(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None))


def any_worker(strategy: tf.distribute.Strategy, flag: bool) -> bool:
    """Whether ``flag`` holds on any worker, the same answer on every worker: a collective
    with several workers (each calls it at the same point), the flag itself with one."""
    import tensorflow as tf

    if num_workers(strategy) == 1:
        return flag
    value = 1.0 if flag else 0.0
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda _: tf.constant(value, tf.float32)
    )
    return float(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)) > 0


# -- the local launcher -------------------------------------------------------------------


def requested_workers() -> int:
    """``SHARDFLOW_TRAIN_WORKERS`` as a count; 1 when unset or under a platform's
    ``TF_CONFIG`` (the platform started this process as one of its workers)."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if not raw or os.environ.get(TF_CONFIG_ENV):
        return 1
    if not raw.isdigit() or int(raw) < 1:
        from tasks.runtime.params import (
            ParamsError,  # here: the stage entry reads this before Prefect
        )

        raise ParamsError(f"{WORKERS_ENV}={raw!r}: set a number of workers (1 or more)")
    return int(raw)


# TensorFlow's error where a worker's server cannot bind the port its TF_CONFIG names. The
# ports are free when picked and bound by the workers seconds later, once TensorFlow is
# imported (it takes a port number, not a socket): another process may take one between.
# The cluster then starts again on other ports, at most CLUSTER_STARTS times in all.
PORT_TAKEN = "Could not start gRPC server"
log = logging.getLogger(__name__)
CLUSTER_STARTS = 3


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now (held open together so no two are the same)."""
    sockets = []
    try:
        for _ in range(count):
            handle = socket.socket()
            handle.bind(("127.0.0.1", 0))
            sockets.append(handle)
        return [handle.getsockname()[1] for handle in sockets]
    finally:
        for handle in sockets:
            handle.close()


def local_tf_configs(workers: int) -> list[str]:
    """One ``TF_CONFIG`` per worker of a cluster on 127.0.0.1, worker 0 the chief."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(workers)]
    return [
        json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}})
        for index in range(workers)
    ]


class WorkerFailed(RuntimeError):
    """A worker of a local multi-worker run died or failed: the run fails (and resumes)."""


def _refusal(error: BaseException) -> BaseException | None:
    """``error`` when it refuses the run's configuration (a ``ParamsError`` or another
    ``Refused``: a rerun as it is fails alike), to travel whole to the launcher; None for
    anything else."""
    from tasks.runtime.params import ParamsError
    from tasks.runtime.refusals import Refused

    return error if isinstance(error, ParamsError | Refused) else None


def _worker_main(
    tf_config: str, fn: Callable[..., Any], args: tuple[Any, ...], messages: Any
) -> None:
    """A spawned worker: its ``TF_CONFIG`` first (read when TensorFlow starts), then ``fn``.

    ``fn(*args, report)`` gets ``report(*message)`` to send epoch figures to the launcher
    (as the tuple ``message``); its result goes back too, and so does its error: as text,
    and whole when it is a refusal of the configuration.
    """
    os.environ[TF_CONFIG_ENV] = tf_config
    index = json.loads(tf_config)["task"]["index"]
    try:
        result = fn(*args, lambda *message: messages.put(("report", index, message)))
    except Preempted as stopped:  # saved where it stood, as every worker did
        messages.put(("preempted", index, str(stopped)))
        raise SystemExit(EXIT_PREEMPTED) from stopped
    except BaseException as error:
        messages.put(("error", index, (f"{type(error).__name__}: {error}", _refusal(error))))
        raise
    messages.put(("result", index, result))


def launch_local_workers(
    workers: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    on_report: Callable[[Any], object] = lambda message: None,
    grace_s: float = DEAD_WORKER_GRACE_S,
) -> Any:
    """Run ``fn(*args, report)`` in ``workers`` spawned processes forming one cluster on
    127.0.0.1; the chief's result. What the chief reports goes to ``on_report``, a tuple.
    A worker that dies or fails stops the others and raises :class:`WorkerFailed` naming
    it: rerun to resume from the last epoch's backup. A worker that refused the
    configuration (a ``ParamsError`` naming the param to change) raises that refusal
    instead: a rerun would fail alike.

    Spawned, never forked: TensorFlow and fork do not mix.
    """
    for start in range(1, CLUSTER_STARTS + 1):
        outcomes = _run_cluster(workers, fn, args, on_report, grace_s)
        if not outcomes.port_taken() or start == CLUSTER_STARTS:
            break
        log.warning(
            "a worker could not bind the port its TF_CONFIG names (%s); the cluster starts "
            "again on other free ports (%d of %d)",
            outcomes.port_taken(),
            start + 1,
            CLUSTER_STARTS,
        )
    outcomes.raise_failure()
    if outcomes.preempted:  # every worker stopped at the step they agreed on
        stopped = ", ".join(str(index) for index in sorted(outcomes.preempted))
        first = outcomes.preempted[min(outcomes.preempted)]
        raise Preempted(f"{first} (workers {stopped} saved it and stopped)")
    return outcomes.results[0]


def _run_cluster(
    workers: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    on_report: Callable[[Any], object],
    grace_s: float,
) -> WorkerOutcomes:
    """One start of the local cluster on ports free now: what its workers sent back."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    processes = [
        context.Process(target=_worker_main, args=(config, fn, args, messages), daemon=True)
        for config in local_tf_configs(workers)
    ]
    for process in processes:
        process.start()
    outcomes = WorkerOutcomes()
    try:
        outcomes.collect(messages, processes, on_report, grace_s)
    finally:
        for process in processes:
            if process.exitcode is None:
                process.kill()
            process.join()
    return outcomes


@dataclass
class WorkerOutcomes:
    """What the workers of one local cluster sent back, or how they ended without a word."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # a worker's own exception
    # of them, the configuration's refusals
    refusals: dict[int, BaseException] = field(default_factory=dict)
    # a worker gone without one (killed, out of memory)
    deaths: dict[int, str] = field(default_factory=dict)
    # a worker stopped by SIGTERM once it saved where it stood
    preempted: dict[int, str] = field(default_factory=dict)

    def port_taken(self) -> str:
        """A worker's error when its server could not bind its port and no worker has a
        result (none trained: the cluster's collectives never formed; the others' errors or
        exits follow from it), else an empty string. A refusal is never retried."""
        if self.results or self.refusals:
            return ""
        return next((e for e in self.errors.values() if PORT_TAKEN in e), "")

    def collect(
        self,
        messages: Any,
        processes: list[Any],
        on_report: Callable[[Any], object],
        grace_s: float,
    ) -> None:
        """Read ``messages`` until every worker has its result, or until ``grace_s`` after
        the first failure (or every worker has ended): the others get that long to say why
        they failed too."""
        failed_at: float | None = None
        while len(self.results) < len(processes):
            try:
                kind, index, payload = messages.get(timeout=0.5)
            except queue.Empty:
                kind = None
            if kind == "report" and index == 0:
                on_report(payload)
            elif kind == "result":
                self.results[index] = payload
            elif kind == "preempted":
                self.preempted[index] = payload
            elif kind == "error":
                text, refusal = payload
                self.errors[index] = f"worker {index} failed: {text}"
                if refusal is not None:
                    self.refusals[index] = refusal
            self.note_deaths(processes)
            if failed_at is None and (self.errors or self.deaths or self.preempted):
                failed_at = time.monotonic()
            if failed_at is not None and (
                time.monotonic() - failed_at > grace_s
                or all(process.exitcode is not None for process in processes)
            ):
                return

    def note_deaths(self, processes: list[Any]) -> None:
        """Each worker that ended with a failing exit code and no error of its own."""
        for index, process in enumerate(processes):
            code = process.exitcode
            known = (self.errors, self.deaths, self.preempted)
            if code not in (None, 0) and all(index not in seen for seen in known):
                self.deaths[index] = f"worker {index} (pid {process.pid}) died, exit code {code}"

    def raise_failure(self) -> None:
        """The configuration's refusal, else :class:`WorkerFailed`, if any worker failed."""
        if self.refusals:  # the params to change, as the worker named them (the chief's first)
            raise self.refusals[min(self.refusals)]
        # A worker that died explains the others' errors (their collectives lost a peer).
        failures = [*self.deaths.values(), *self.errors.values()]
        if failures:
            raise WorkerFailed(
                f"multi-worker training failed: {failures[0]}; the other workers were "
                "stopped. Rerun the train stage: it resumes from the last epoch's backup."
            )
