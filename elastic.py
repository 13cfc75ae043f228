"""The fault layer: how a run survives a role's death or hang. Nothing here is the paper's algorithm;
it keeps the algorithm's promises while roles die, hang and come back:

  1. every trained model token has 0 <= lag <= actor.max_lag;
  2. every group is trained whole, in one step, and once, judged by copy (its ticket), and no group
     id is skipped: each one below the largest trained is trained, dropped or in flight at the end;
  3. every sample started is trained, dropped or given back, by the ledger's own records;
  4. a death or a hang stalls training for at most run.hang_timeout_s + run.restart_s.

Who owns what. One process, started first on node 0 and never started again (its death ends the
run: run.sh stops every node), owns the run's TCPStore (the weight rosters' rendezvous and the
announcements, weights_sync.py), the ledger (section 2) and node 0's watchdog (section 3):
`python elastic.py [k=v ...]`. Every other node runs its own watchdog: `python elastic.py watch`.
The roles reach the ledger at a few named points of their loops (common.LedgerClient; the
requests are typed and parsed in one place, common.REQUESTS): the actor to say hello and to ask for
tickets, the verifier to forward or drop groups, trainer rank 0 to say hello, to report the groups
it trained or lost on the way, and (its weight sender) to learn which actors are alive.
docs/DESIGN.md, "The fault layer", gives the invariants and their proofs.

Sections, in the order a run needs them: 1. the store's death; 2. the ledger; 3. liveness; 4. the
process.
"""
import contextlib
import heapq
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import zmq
from torch.distributed.elastic.timer import FileTimerClient, FileTimerServer

import common
import weights_sync as ws
from scripts import rundir

# --- 1. the store: its death ends every role ------------------------------------------------------
# Invariant: a role that finds the run's store gone (this process) says so in one line and exits
# with STORE_LOST; run.sh then stops its node's roles. Owns: nothing.

# a role's exit status when the run's store (this file's process) went away: run.sh then stops
# the node's roles
STORE_LOST = 3


async def unless_store_lost(store, awaitable):
    """Await `awaitable`, checking every second that the run's store is there: a connect to a store
    that went away waits out its whole timeout (sync.timeout_s), and so would this role."""
    import asyncio
    task = asyncio.ensure_future(awaitable)
    while not (await asyncio.wait({task}, timeout=1.0))[0]:
        try:
            store.check(["announced"])  # DistNetworkError: the store went away
        except Exception:
            task.cancel()
            raise
    return task.result()


def store_lost(role: str, error) -> int:
    """One line naming the store, for a role that lost it -> the exit status run.sh reads."""
    print(f"[{role}] lost the run's store (sync.host:sync.port: elastic.py, which run.sh starts on "
          f"node 0): {error}", file=sys.stderr, flush=True)
    return STORE_LOST

# --- 2. the ledger: tickets ------------------------------------------------------------------------
# Invariant: every ticket issued is open (issued -> pushed -> forwarded) or closed once: trained,
# dropped or given back; the group id of a ticket given back is granted again before any new id;
# a ticket is forwarded only while open and not yet forwarded, and once forwarded it is given back
# only when it is lost on the way or its trainer epoch ends. Owns: the open tickets, the ids to
# grant again, the incarnations (actors, verifiers, trainer epochs), when each live actor last
# spoke, and the journal <run.dir>/ledger.jsonl, one line per change (scripts/check_run.py).


@dataclass
class Ticket:
    """One copy of a group: its group id may be granted again under another ticket."""
    group: int     # the group id: the prompt's index in the seeded stream (tasks.py)
    inc: int       # the actor incarnation it was granted to
    version: int   # that actor's version then: every token of it is sampled by this one or later
    epoch: int     # the trainer epoch it belongs to
    state: str = "issued"  # issued -> pushed (its samples sent to the verifier) -> forwarded
    verifier: int = 0      # pushed or forwarded: the verifier incarnation it went to
    order: int = 0         # forwarded: its index in that verifier's forwards


class Ledger:
    """The books, in memory, and their journal. `handle` answers one request."""

    def __init__(self, cfg):
        self.cfg, path = cfg, cfg.run_dir / "ledger.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        # numbering goes on from a resumed run's journal: a ticket, an incarnation, an epoch once
        top = rundir.journal_maxima(path)
        self.journal = open(path, "a", buffering=1)
        self.next_ticket, self.next_inc = top["ticket"] + 1, top["inc"] + 1
        self.verifier, self.epoch = top["verifier"], top["epoch"]
        self.open = {}  # open: ticket -> Ticket
        self.redo = []  # heap of the group ids given back: granted first, smallest first
        self.next_group = 0  # no id at or above it was ever granted in this epoch's timeline
        self.version = -1  # the trainer's version as last reported (-1: no trainer yet)
        self.forwards = {}  # verifier incarnation -> the tickets it forwarded (its next order)
        self.actors = {}  # live actor incarnation -> when it last spoke (this host's clock)
        self.looked = time.monotonic()  # when silence was last looked at (`check_silence`)
        self.void = []  # [ticket, group id] given back since the verifier's last request: it drops their parts
        self.dropped = []  # group ids dropped since trainer rank 0's last request (its done set)
        self.note("start", pid=os.getpid())  # (a resumed run's new start: no stall across it)

    def handle(self, frame: bytes) -> dict:
        try:
            kind, request = common.parse_request(frame)
            return getattr(self, kind)(request)
        except (ValueError, KeyError, TypeError) as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def note(self, event: str, **fields):
        self.journal.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")

    # --- the actors: hello, and tickets by the lag budget ---
    def actor_hello(self, r) -> dict:
        inc, self.next_inc = self.next_inc, self.next_inc + 1
        self.actors[inc] = time.monotonic()
        self.note("hello", role="actor", inc=inc, pid=r["pid"], host=r["host"])
        return {"inc": inc, "verifier": self.verifier}

    def tickets(self, r) -> dict:
        """Its pushes and drops are noted; then tickets, while `admit` allows one more group. An
        incarnation counted lost is told so (it cancels everything and says hello)."""
        inc = r["inc"]
        if inc not in self.actors:
            return {"lost": True}
        self.actors[inc] = time.monotonic()
        for k, verifier in r["pushed"]:
            t = self.open.get(k)
            if t is not None and t.state == "issued" and verifier == self.verifier:
                t.state, t.verifier = "pushed", verifier
            elif t is not None and t.state == "issued":  # its verifier has restarted since
                self.give_back([k], f"pushed to verifier {verifier}, which has restarted")
        for k, why in r["drop"]:
            self.drop(k, why)
        granted = []
        # only with the current trainer epoch's weights (a restarted trainer's versions start over)
        while r["epoch"] == self.epoch and len(granted) < r["want"] and self.admit(r["version"]):
            granted.append(self.grant(inc, r["version"]))
        return {"lost": False, "tickets": granted, "verifier": self.verifier}

    def admit(self, version: int) -> bool:
        """May one more group of group_size samples start, with the weights of `version`, without
        any token exceeding actor.max_lag? One budget for the run, every actor's groups in it.

        outstanding: samples granted and neither trained nor given back; t: the trainer's version,
        reported together with the samples it trained (the two move together); u_min: the oldest
        version a group not yet forwarded by the verifier started with, the new one included.
        Admit while outstanding + group_size <= (u_min - t + max_lag + 1) * B.
        Why: the trainer trains B samples a step, whole groups in the order the verifier forwards
        them (trainer.whole_groups). Take a group G started at version u, and the last admission
        before the verifier forwarded G, at trainer version t* (u_min* <= u then: G was not yet
        forwarded). Every sample trained before G was trained by then or outstanding then, so G is
        among the first (t* - S) * B + (u_min* - t* + max_lag + 1) * B samples of the trainer's
        epoch (started at version S): trained by version u_min* + max_lag <= u + max_lag, and its
        tokens were sampled by versions >= u. Nothing stalls: once the groups in flight are
        forwarded, u_min is the newest version and the budget covers the trainer's next step. A
        slow actor's old group holds every actor's admission, as it must.
        Conventional: B*G_steps samples per RL step (fewer for the first after resuming
        mid-RL-step), all with the RL step's weights (version t - t % G_steps), then none until
        the next RL step's weights."""
        a, t = self.budget, self.version
        b, gs = a["batch_size"], a["group_size"]
        outstanding = gs * len(self.open)
        if a["schedule"] == "conventional":
            rl_step_weights = version >= t - t % a["G_steps"]
            return rl_step_weights and outstanding + gs <= (a["G_steps"] - t % a["G_steps"]) * b
        u_min = min([k.version for k in self.open.values() if k.state != "forwarded"] + [version])
        return outstanding + gs <= (u_min - t + a["max_lag"] + 1) * b

    def grant(self, inc: int, version: int) -> list:
        group = heapq.heappop(self.redo) if self.redo else self.next_group
        self.next_group = max(self.next_group, group + 1)
        k, self.next_ticket = self.next_ticket, self.next_ticket + 1
        self.open[k] = Ticket(group, inc, version, self.epoch)
        self.note("issued", ticket=k, group=group, inc=inc, version=version, epoch=self.epoch)
        return [k, group]

    def give_back(self, tickets: list, why: str):
        for k in tickets:
            t = self.open.pop(k)
            heapq.heappush(self.redo, t.group)
            self.void.append([k, t.group])
        self.note("given_back", tickets=tickets, why=why)

    def drop(self, k: int, why: str):
        """A group that is never trained (zero advantage, malformed): its id is done for good."""
        t = self.open.get(k)
        if t is not None and t.state != "forwarded":
            del self.open[k]
            self.dropped.append(t.group)
            self.note("dropped", ticket=k, group=t.group, why=why)

    # --- the verifier: forwards, accepted while open; a restart gives back what it held ---
    def verifier_hello(self, r) -> dict:
        self.verifier += 1
        self.forwards[self.verifier] = 0
        held = [k for k, t in self.open.items() if t.state == "pushed"]
        self.note("hello", role="verifier", verifier=self.verifier)
        if held:
            self.give_back(held, f"pushed to a verifier before incarnation {self.verifier}")
        self.void = []  # (the new verifier holds none of their samples)
        return {"verifier": self.verifier}

    def forward(self, r) -> dict:
        """Drops, then forwards: each accepted gets its order (the verifier sends the accepted in
        this order, the trainer judges losses by it); the rest were given back: discarded."""
        if r["verifier"] != self.verifier:
            return {"accepted": [], "void": []}  # an older incarnation: it forwards nothing
        for k, why in r["drop"]:
            self.drop(k, why)
        accepted = []
        for k in r["forward"]:
            t = self.open.get(k)
            if t is not None and t.state != "forwarded":
                order = self.forwards[self.verifier]
                t.state, t.verifier, t.order = "forwarded", self.verifier, order
                self.forwards[self.verifier] += 1
                accepted.append([k, order])
        if accepted:
            self.note("forwarded", tickets=accepted, verifier=self.verifier)
        void, self.void = self.void, []
        return {"accepted": accepted, "void": void}

    # --- trainer rank 0: its epochs, the groups it trained, the ones lost on the way ---
    def trainer_hello(self, r) -> dict:
        """A trainer start: a new epoch from its checkpoint's step; every open ticket is given back
        (its tokens may come from versions this trainer never had), and every id its checkpoint
        does not hold done is granted again first, trained since the checkpoint or not."""
        self.epoch, self.version = max(self.epoch, r["epoch"]) + 1, r["step"]
        self.budget = r["budget"]  # (the trainer's settings: its B is the one the bound needs)
        if self.open:
            self.give_back(list(self.open), f"trainer epoch {self.epoch} started")
        done = set(r["done_above"])
        self.next_group = max([self.next_group, r["done_below"], *(g + 1 for g in done)])
        self.redo = [g for g in range(r["done_below"], self.next_group) if g not in done]
        self.dropped = []
        self.note("hello", role="trainer", epoch=self.epoch, step=r["step"], redo=self.redo,
                  next=self.next_group)
        return {"epoch": self.epoch, "forwards": sorted(self.forwards.items())}

    def report(self, r) -> dict:
        """The groups trained, with the version their step made (one request: the budget's count
        and its version move together), and the forwarded groups the trainer found lost on the
        way (it judges them, every rank alike: trainer.whole_groups). -> the group ids dropped
        since (the trainer's done set) and every verifier's forwards so far (where its orders
        end: the trainer waits for no order past them)."""
        if r["epoch"] == self.epoch:
            self.version = r["version"]
            for k in r["trained"]:
                del self.open[k]
            if r["trained"]:
                self.note("trained", tickets=r["trained"], version=self.version, epoch=self.epoch)
            gone = {(v, o) for v, o in r["lost"]}
            lost = [k for k, t in self.open.items()
                    if t.state == "forwarded" and (t.verifier, t.order) in gone]
            if lost:
                self.give_back(lost, "lost on the way")
        dropped, self.dropped = self.dropped, []
        return {"dropped": dropped, "forwards": sorted(self.forwards.items())}

    def members(self, r) -> dict:
        return {"live": sorted(self.actors)}

    def lost(self, r) -> dict:
        self.lose(r["inc"], r["why"])
        return {}

    # --- liveness of the actors: silence, or the trainer's word ---
    def lose(self, inc: int, why: str):
        """An actor incarnation is lost for good: what it holds that no verifier has forwarded is
        given back (its forwarded groups are whole at the verifier: they are trained)."""
        if self.actors.pop(inc, None) is None:
            return
        mine = [k for k, t in self.open.items() if t.inc == inc and t.state != "forwarded"]
        self.note("lost", inc=inc, why=why)
        print(f"[ledger] actor incarnation {inc} lost: {why}; {len(mine)} groups given back",
              flush=True)
        if mine:
            self.give_back(mine, f"actor incarnation {inc} lost")

    def check_silence(self):
        """An actor silent for run.heartbeat_timeout_s is lost, counting only time this process
        served: after a stall of its own (a slow disk, a stop) every actor would look silent."""
        now, limit = time.monotonic(), self.cfg.run.heartbeat_timeout_s
        if now - self.looked > 1.0:
            self.actors = {inc: seen + now - self.looked for inc, seen in self.actors.items()}
        self.looked = now
        for inc, seen in list(self.actors.items()):
            if now - seen > limit:
                self.lose(inc, f"silent for {limit:.0f} s (run.heartbeat_timeout_s)")


# --- 3. liveness: each node's watchdog (torch.distributed.elastic.timer) --------------------------
# Invariant: a role process that makes no progress for run.hang_timeout_s (a SIGSTOPped one too) is
# killed and named, and run.sh starts it again. Progress is the role's own: a role waiting on a peer
# re-arms (the peer has its own watchdog), so none is killed for another's hang. Owns: each node's
# timers, one per role process (`Progress`).


def watchdog_path(cfg) -> str:
    node = os.environ.get("NODE_RANK", "0")
    return os.path.join(tempfile.gettempdir(), f"pipelinerl-{cfg.sync.port}-node{node}.watchdog")


class Watchdog(FileTimerServer):
    """torch's file timer server, checking every second; an expired process is named in one line,
    here and in its own log (its stderr), then SIGKILLed. Unlike torchrun's, it never kills its
    own process, which holds the run (or the node's watchdog)."""

    def __init__(self, cfg):
        super().__init__(watchdog_path(cfg), run_id="pipelinerl", max_interval=1.0)

    def _reap_worker(self, worker_pid: int, signal_number: int) -> bool:
        if worker_pid == os.getpid() or not self.is_process_running(worker_pid):
            return True  # an exited process has nothing to name
        scopes = "; ".join(r.scope_id for (pid, _), r in self._timers.items() if pid == worker_pid)
        line = f"[watchdog] {scopes}: killed (pid {worker_pid})"
        print(line, flush=True)
        with contextlib.suppress(OSError), open(f"/proc/{worker_pid}/fd/2", "a") as err:
            err.write(line + "\n")
        return super()._reap_worker(worker_pid, signal_number)


class Progress:
    """A role's side of its node's watchdog: `made()` re-arms its timer, run.hang_timeout_s from
    now (at most once a second). With no watchdog on the node (a role started alone): nothing."""

    def __init__(self, cfg=None, what: str = ""):
        path = watchdog_path(cfg) if cfg is not None else ""
        self.client = FileTimerClient(path) if os.path.exists(path) else None
        self.bound, self.armed = cfg.run.hang_timeout_s if cfg else 0.0, 0.0
        self.scope = f"{what}: no progress for {self.bound:.0f} s (run.hang_timeout_s)"

    def made(self):
        now = time.time()
        if self.client is not None and now - self.armed >= 1.0:
            self.armed = now
            with contextlib.suppress(OSError):  # the node's watchdog gone: run.sh says so
                self.client.acquire(self.scope, now + self.bound)

    def release(self):
        """No more progress to watch: the loop ended (what follows has bounds of its own)."""
        if self.client is not None:
            with contextlib.suppress(OSError):
                self.client.release(self.scope)

# --- 4. the process: node 0's store, ledger and watchdog; other nodes' watchdog ---------------------


def serve(cfg):
    """Until SIGTERM or SIGINT: the store, the watchdog, and the ledger answering on
    ports.host:ports.ledger; every 0.2 s the actors' silence is looked at."""
    store = ws.create_store(cfg.sync.host, cfg.sync.port, True, cfg.run.peer_timeout_s)
    Watchdog(cfg).start()
    ledger = Ledger(cfg)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(common.zmq_addr(cfg.ports.host, cfg.ports.ledger))
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    print(f"[store] serving at {cfg.sync.host}:{store.port}; ledger at "
          f"{cfg.ports.host}:{cfg.ports.ledger}", flush=True)
    while not stop:
        if sock.poll(200):
            sender, empty, frame = sock.recv_multipart()
            sock.send_multipart([sender, empty, json.dumps(ledger.handle(frame)).encode()])
        ledger.check_silence()


def watch(cfg):
    """A node without the store: its watchdog alone, until SIGTERM or SIGINT."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    Watchdog(cfg).start()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    # python elastic.py [watch] [section.key=value ...]
    args = sys.argv[1:]
    if args[:1] == ["watch"]:
        watch(common.parse_argv(args[1:]))
    else:
        serve(common.parse_argv(args))
