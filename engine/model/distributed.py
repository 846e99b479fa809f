"""Data-parallel runs on torch.distributed: one model replica per rank, the N_s masked forwards of a step shared out.

Started by torchrun (WORLD_SIZE and RANK in the environment), `python -m engine prune ...` runs data-parallel with
no other flag; started any other way it is one process and torch.distributed is never imported.

    world = join_world(device)                 # World() outside torchrun
    executor = world.share_executor(executor)  # each rank runs share(N_s, K, rank) of the masks; losses all-gathered

Every rank draws the same calibration batch and the same N_s masks from the same seeded generators, runs its share
of the masked forwards, and receives every loss; the update that follows is computed on every rank from the same
numbers, so the scores never drift apart (a hook checks a digest of the state on every step). Rank 0 alone writes
the run folder; the others write their (identical) checkpoints into a scratch folder of their own and export
nothing. A rank that dies or stops answering ends the others' collectives with RankLost (gloo: at once, when the
connection closes; otherwise after the timeout, $PG_PRUNE_DIST_TIMEOUT seconds, default 600).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
import time
from array import array
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch

from ..errors import UserError
from ..algo.evaluate import batch_loss

TIMEOUT_ENV = "PG_PRUNE_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 600.0


def launched(env=os.environ) -> bool:
    """Was this process started by torchrun (or an equivalent launcher) as one of several ranks?"""
    return "RANK" in env and int(env.get("WORLD_SIZE", "1")) > 1


def share(n: int, k: int, rank: int) -> range:
    """The mask samples (0 .. n-1) that rank `rank` of `k` evaluates: contiguous, the first n % k ranks one more
    (n = 3 over 2 ranks: 0, 1 and 2). A rank may get none (n < k)."""
    if k < 1 or not 0 <= rank < k or n < 0:
        raise ValueError(f"no share of {n} samples for rank {rank} of {k}")
    base, extra = divmod(n, k)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def dealt(n: int, k: int, rank: int) -> range:
    """Every k-th item from `rank` on (n = 5 over 2 ranks: 0, 2, 4 and 1, 3): the split for items whose cost falls
    along the list (Layerwise-PPL's and SLEB's candidate layers: removing an early layer runs every later one), so
    that each rank gets a like mix of dear and cheap ones. A rank may get none (n < k)."""
    share(n, k, rank)  # (the same checks)
    return range(rank, n, k)


def shares(n: int, k: int) -> list[list[int]]:
    """Which samples each rank evaluates (results.json's `mask_samples_by_rank`)."""
    return [list(share(n, k, r)) for r in range(k)]


def on_cpu(obj: Any) -> Any:
    """obj with every tensor in it (in dicts, lists and tuples) moved to the CPU: what crosses between ranks as an
    object (a CUDA tensor would be unpickled on the sender's GPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(x) for x in obj)
    return obj


def timeout_seconds(env=os.environ) -> float:
    text = env.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text.strip() else DEFAULT_TIMEOUT
    except ValueError:
        raise UserError(f"${TIMEOUT_ENV} must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise UserError(f"${TIMEOUT_ENV} must be positive, got {text!r}")
    return value


def digest(*parts: Any) -> int:
    """A 63-bit digest of tensors (their bytes), numbers and strings, in order: what the ranks compare."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, torch.Tensor):
            t = p.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(p, dict):
            for k in sorted(p, key=str):
                h.update(repr(k).encode())
                h.update(digest(p[k]).to_bytes(8, "little"))
        elif isinstance(p, (list, tuple)):
            for x in p:
                h.update(digest(x).to_bytes(8, "little"))
        else:
            h.update(repr(p).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def token_digest(value: Any) -> int:
    """A 63-bit digest of token ids or texts, fast for many documents: tensors, lists of ints (a tokenizer's
    input_ids), strings, and lists of these, nested."""
    h = hashlib.blake2b(digest_size=8)

    def add(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, str):  # (a document, or the evaluation text: its bytes, not a repr's copy)
            data = x.encode("utf-8", "surrogatepass")
            h.update(f"str{len(data)}".encode())
            h.update(data)
        elif isinstance(x, (list, tuple)) and x and all(isinstance(i, int) for i in x):
            h.update(f"ids{len(x)}".encode())
            h.update(array("q", x).tobytes())
        elif isinstance(x, (list, tuple)):
            h.update(f"[{len(x)}".encode())
            for y in x:
                add(y)
        else:
            h.update(repr(x).encode())

    add(value)
    return int.from_bytes(h.digest(), "little") >> 1


def weights_digest(model) -> int:
    """A 63-bit digest of a model's weights: each tensor of its state (a tied one once) by name, dtype, shape and
    bytes, sha1 on the CPU (SmolLM2-135M's 540 MB in 0.4 s on one shared core; blake2b took 0.7 s). Weights on the
    meta device (offloaded by --device auto) count by their name and shape. What the ranks compare before the first
    forward (World.check_data): their settings and their model files' names and sizes agree already (agree), yet
    one rank's files may hold other weights of the same size."""
    h, seen = hashlib.sha1(), set()
    for name, t in model.state_dict().items():
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        if t.device.type == "meta" or t.numel() == 0 or (t.device, t.data_ptr()) in seen:
            continue
        seen.add((t.device, t.data_ptr()))
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return int.from_bytes(h.digest()[:8], "little") >> 1


def backend_reason(e: BaseException) -> str:
    """The backend's reason in a few words: its first sentence, without gloo's source location."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    first = re.sub(r"^(\[[^\]]*\]\s*)+", "", first).split(". ")[0].strip().rstrip(".")
    return first[:160] or type(e).__name__


class RankLost(UserError):
    """Another rank died or stopped answering. The state of the last finished step is whole: the writer saves it
    (as an interrupt does) so that the run resumes there, with any number of ranks."""

    checkpoint_safe = True


class Collectives:
    """The collectives of a World (below), each of which turns a lost peer into RankLost; in one process each is
    the identity and starts nothing."""

    rank: int
    size: int
    device: str

    def _collective(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RuntimeError as e:  # gloo's closed connections, timeouts and NCCL's errors are RuntimeErrors
            raise RankLost(f"rank {self.rank} of {self.size}: another rank died or stopped answering during {what} "
                           f"({backend_reason(e)})") from None

    def gather_shares(self, local: torch.Tensor, n: int, what: str = "the mask samples' losses") -> torch.Tensor:
        """Every rank's share of n float64 values (local: this rank's, share(n, K, rank)), in sample order."""
        import torch.distributed as dist

        width = -(-n // self.size)
        padded = torch.zeros(width, dtype=torch.float64, device=self.device)
        padded[:local.numel()] = local.to(self.device, torch.float64)
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._collective(what, lambda: dist.all_gather(parts, padded))
        return torch.cat([parts[r][:len(share(n, self.size, r))] for r in range(self.size)]).cpu()

    def gather_objects(self, obj: Any, what: str) -> list:
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size
        self._collective(what, lambda: dist.all_gather_object(out, obj))
        return out

    def from_writer(self, obj: Any, what: str) -> Any:
        """Rank 0's `obj` on every rank (the others pass None)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        self._collective(what, lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def add_up(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """The sum over the ranks of t (each rank's partial sum), added in float64 and returned in t's dtype and on
        its device. For two ranks this rounds as t0 + t1 in t's dtype does (a float64 sum of two float32 or
        bfloat16 values rounds back as their sum in that dtype would); for more, to within that dtype's rounding.
        One process: t itself."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        total = t.detach().to(self.device, torch.float64, copy=True)
        self._collective(what, lambda: dist.all_reduce(total))
        return total.to(t.device, t.dtype)


@dataclass(frozen=True)
class World(Collectives):
    """This process's place among the ranks of a run. World() is one process: every collective is the identity."""

    rank: int = 0
    size: int = 1
    backend: str | None = None  # gloo (CPU tensors) or nccl (tensors on this rank's GPU)
    device: str = "cpu"  # where the collectives' tensors live

    @property
    def writes(self) -> bool:
        """Only rank 0 writes the run folder, shows progress and exports."""
        return self.rank == 0

    def describe(self) -> dict:
        return {"world_size": self.size, "backend": self.backend}

    def check_same(self, what: str, *parts: Any) -> None:
        """Raise UserError when the ranks' digests of `parts` differ (nothing to do in one process)."""
        if self.size == 1:
            return
        mine = digest(*parts)
        seen = self.gather_objects(mine, what)
        if len(set(seen)) > 1:
            odd = [r for r, d in enumerate(seen) if d != seen[0]]
            raise UserError(f"the ranks disagree on {what}: rank{'s' if len(odd) > 1 else ''} "
                            f"{', '.join(map(str, odd))} differ{'' if len(odd) > 1 else 's'} from rank 0 (digests "
                            f"{', '.join(f'{d:016x}' for d in seen)}); the run stopped before writing it")

    def check_data(self, data: dict[str, tuple[Any, str]]) -> None:
        """Before the first forward: the ranks compare a digest of each named data they read (name -> (its token ids:
        lists of ints or tensors, or a function giving what to digest, called only with several ranks: the model's
        weights_digest; where it came from)). The settings agree already (agree, below), yet a rank may read other
        files under the same settings (its own $PG_PRUNE_DATA_DIR, other files at the same path): refused in one
        line naming the data, the ranks that differ and where each read it. One process: nothing to do."""
        if self.size == 1:
            return
        mine = {name: (token_digest(value() if callable(value) else value), source)
                for name, (value, source) in data.items()}
        seen = self.gather_objects(mine, "the digests of the data they read")
        for name in data:
            digests = [s[name][0] for s in seen]
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            if odd:
                r = odd[0]
                same = " (the same path, other content)" if seen[0][name][1] == seen[r][name][1] else ""
                raise UserError(f"the ranks read different {name}: rank 0 {seen[0][name][1]}, rank {r} "
                                f"{seen[r][name][1]}{same}; stopped before the first forward: give every rank the same files")

    def agree(self, errors_and_values: tuple[str | None, Any], what: str) -> None:
        """Start-up: every rank hands in (its error or None, the digest of what it will run). The first error (by
        rank) ends every rank with that line; different digests end them as a mismatched world."""
        if self.size == 1:
            if errors_and_values[0]:
                raise UserError(errors_and_values[0])
            return
        seen = self.gather_objects(errors_and_values, what)
        failed = [(r, e) for r, (e, _) in enumerate(seen) if e]
        if failed:
            r, e = failed[0]
            raise UserError(e if r == self.rank or self.size == 1 else f"rank {r}: {e}")
        digests = [d for _, d in seen]
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise UserError(f"a mismatched world: rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} "
                            f"would run another job than rank 0 ({what} differ); start every rank with the same "
                            "command, model files and data")

    # --- the narrow places where work is shared out -------------------------------------------------------
    def mine(self, n: int, split: Callable[[int, int, int], range] = share) -> range:
        """The items (0 .. n-1) this rank works on: split(n, K, rank); all of them in one process."""
        return split(n, self.size, self.rank)

    def map_shares(self, items: list, fn: Callable[[list], list], what: str,
                   split: Callable[[int, int, int], range] = share) -> list:
        """fn on this rank's share of `items` (split(n, K, rank); fn gets a list and returns one result per item),
        every item's result on every rank, in item order (tensors come back on the CPU). An item's result is the
        same whichever rank computes it, so the list is the one process's, bit for bit. One process: fn(items)."""
        items = list(items)
        if self.size == 1:
            return list(fn(items))
        mine = self.mine(len(items), split)
        local = on_cpu(list(fn([items[j] for j in mine]))) if len(mine) else []
        if len(local) != len(mine):
            raise ValueError(f"{what}: {len(local)} results for {len(mine)} items")
        out: list = [None] * len(items)
        for r, part in enumerate(self.gather_objects(local, what)):
            for j, x in zip(split(len(items), self.size, r), part):
                out[j] = x
        return out

    def spread(self, n: int, value: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """(n,) float64: value(j) for every sample j, in order, this rank computing its share (share()) and the
        others' gathered; one process computes them all."""
        mine = range(n) if self.size == 1 else share(n, self.size, self.rank)
        local = torch.cat([value(j).double().reshape(-1) for j in mine]) if len(mine) else torch.empty(0, dtype=torch.float64)
        return local if self.size == 1 else self.gather_shares(local, n)

    def share_executor(self, executor: Callable) -> Callable:
        """An executor (engine/model/executors.py) that evaluates only this rank's share of the samples and returns
        every sample's loss. One process: the executor itself."""
        if self.size == 1:
            return executor

        def shared(hooks, layout, batch, samples, comp_means=None, score=batch_loss):
            n = next(iter(samples.values())).shape[0]
            mine = share(n, self.size, self.rank)
            local = (executor(hooks, layout, batch, {u: m[mine.start:mine.stop] for u, m in samples.items()}, comp_means, score)
                     if len(mine) else torch.empty(0, dtype=torch.float64))
            return self.gather_shares(local, n)

        return shared

    def leave(self, clean: bool = True) -> None:
        """Leave the process group (not after a lost rank: a dead peer could make the goodbye hang)."""
        if self.size == 1 or not clean:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


PARENT_GRACE_SECONDS = 30.0  # after SIGTERM, how long a rank whose launcher died has to start acting on it
SAVE_GRACE_SECONDS = 600.0  # and, once its main thread acts on it (rank 0 saves its last step), to end


def end_with_parent(interval: float = 1.0) -> threading.Thread:
    """A rank ends when the launcher that started it dies (a kill -9 of torchrun leaves no one to stop the ranks): a
    daemon thread polls the parent's process id and, once the rank has been handed to another parent, sends this
    process SIGTERM, which the CLI turns into an interrupt (rank 0 saves its last finished step; the other ranks'
    collectives end as their peers go). A rank whose main thread does not act on it within PARENT_GRACE_SECONDS
    (it waits in C code that never returns to Python: a NCCL collective whose peer is gone), or that has not ended
    SAVE_GRACE_SECONDS after acting on it (a hung write), is ended by the thread itself, with one line saying why:
    no rank outlives its launcher for long. Call it from the main thread, after the SIGTERM handler is set."""
    parent = os.getppid()
    acted = threading.Event()
    previous = signal.getsignal(signal.SIGTERM)
    if callable(previous):  # (the CLI's handler: it runs in the main thread only once that thread is in Python)
        def on_sigterm(signum, frame):
            acted.set()
            return previous(signum, frame)

        try:
            signal.signal(signal.SIGTERM, on_sigterm)
        except ValueError:  # (not the main thread: no handler to watch)
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)
        if acted.wait(PARENT_GRACE_SECONDS):
            time.sleep(SAVE_GRACE_SECONDS)
            why = f"SIGTERM did not end this rank within {SAVE_GRACE_SECONDS:g} s"
        else:
            why = f"SIGTERM was not acted on within {PARENT_GRACE_SECONDS:g} s (the rank waits in C code)"
        os.write(2, f"error: rank {os.environ.get('RANK', '?')}: its launcher (process {parent}) is gone and {why}; "
                    "ending it now\n".encode())
        os._exit(128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name="pg-prune-parent-watch", daemon=True)
    thread.start()
    return thread


def join_world(device: str, env=os.environ) -> World:
    """World() outside torchrun; under it, this rank's World, its process group started (gloo, or NCCL for
    --device cuda) with the collectives' timeout. --device auto (one replica spread over every GPU of the machine)
    takes one rank per machine."""
    if not launched(env):
        return World()
    import torch.distributed as dist

    end_with_parent()
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_size = int(env.get("LOCAL_WORLD_SIZE", size))
    on_gpus = device.startswith("cuda")
    if device == "auto" and local_size > 1:
        raise UserError(f"--device auto spreads one replica over every GPU of the machine, and {local_size} ranks "
                        "were started on this one: give each rank its GPU (--device cuda) or start one rank per machine "
                        "(torchrun --nproc-per-node 1)")
    where = "cpu"
    if on_gpus:
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: no CUDA device on this machine")
        local = int(env.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():
            raise UserError(f"rank {rank} is local rank {local}, but this machine has {torch.cuda.device_count()} "
                            "CUDA devices: start at most one rank per GPU")
        torch.cuda.set_device(local)  # --device cuda is this rank's GPU
        where = f"cuda:{local}"
    backend = "nccl" if on_gpus else "gloo"
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_seconds(env)))
    except (RuntimeError, ValueError) as e:
        raise UserError(f"rank {rank} of {size} could not join the others ({backend}: {backend_reason(e)})") from None
    return World(rank=dist.get_rank(), size=dist.get_world_size(), backend=backend, device=where)
