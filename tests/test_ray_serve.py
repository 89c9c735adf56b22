"""Ray Serve replicas (kvexport/ray_serve.py) on a local two-node Ray cluster (two raylets on this
machine, one CPU each): the same OpenAI routes through Ray Serve's proxy and router, spoken to through
the official `openai` client, with the trained default model so that every answer can be compared
token for token with the same request served alone. One cluster for the module (Ray starts slowly)."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import kvexport  # noqa: E402
from kvexport.errors import InputError  # noqa: E402
from kvexport.ray_serve import APP_NAME, NODE_HEADER, REPLICA_HEADER, application  # noqa: E402
from kvexport.runtime.engine import Engine  # noqa: E402
from kvexport.runtime.scheduler import Scheduler  # noqa: E402
from kvexport.zoo import write_named  # noqa: E402

T = 120  # seconds: the bound on every wait
MODEL = "default"
ACTOR_PREFIX = f"SERVE_REPLICA::{APP_NAME}#KvexportReplica#"
PROMPTS = ["def ", "import os\n", "class A:\n    def", "for i in range(", "return self.", "if x is None:\n",
           "print(", "with open("]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvexport.build import build

    d = tmp_path_factory.mktemp("ray")
    return build(write_named("default", d / "ck"), d / "default.kvx", target="cpu", max_seq=1024, verify=False)


@pytest.fixture(scope="module")
def engine(artifact: Path) -> Engine:
    return kvexport.load(artifact, threads=1)


@pytest.fixture(scope="module")
def cluster(artifact: Path) -> Iterator[str]:
    """Two Ray nodes with one CPU each; the application's replicas (one per node) on them."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    # Ray Serve kills a proxy not ready within 5 s and one whose health check takes 10 s; a loaded 2-core machine
    # (the suite's other worker building) starts a proxy slower than that. The raylets pass this environment on.
    slow = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
    saved = {k: os.environ.get(k) for k in slow}
    os.environ.update(slow)
    node = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        c.add_node(**node)
        ray.init(address=c.address, logging_level="error", log_to_driver=False)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(str(artifact), replicas=2, max_batch=8, max_queue=64, threads=1, model_name=MODEL),
                  name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _client(url: str, **kw: Any) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=T, **kw)


def _sampling(i: int) -> dict[str, Any]:
    return {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}


def _replicas() -> set[str]:
    """The ids of the live replicas (Ray Serve names each replica's actor after its id)."""
    import ray

    return {a["name"].removeprefix(ACTOR_PREFIX) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(ACTOR_PREFIX)}


def _actor(replica: str) -> Any:
    import ray

    return ray.get_actor(ACTOR_PREFIX + replica, namespace="serve")


def test_application_refuses_bad_arguments_before_ray(tmp_path: Path, artifact: Path) -> None:
    with pytest.raises(InputError, match="not an artifact folder"):
        application(str(tmp_path))
    with pytest.raises(InputError, match="replicas"):
        application(str(artifact), replicas=0)


def test_two_replicas_64_concurrent_requests(cluster: str, engine: Engine) -> None:
    """64 requests at once (greedy and seeded, plain and streamed) through Ray Serve's router: each
    equals the same request served alone, and both replicas, on different nodes, answered."""
    placed = _replicas()
    assert len(placed) == 2
    client = _client(cluster)
    alone = [engine.generate(PROMPTS[i % len(PROMPTS)], 16, **_sampling(i)) for i in range(64)]

    def one(i: int) -> tuple[str, tuple[str, str]]:
        kw = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16, **_sampling(i)}
        if i % 4 == 3:
            stream = client.completions.with_raw_response.create(stream=True, **kw)
            text = "".join(c.choices[0].text for c in stream.parse() if c.choices)
        else:
            stream = client.completions.with_raw_response.create(**kw)
            text = stream.parse().choices[0].text
        return text, (stream.headers[REPLICA_HEADER], stream.headers[NODE_HEADER])

    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(one, range(64)))
    assert [t for t, _ in got] == [a.text for a in alone]
    answered = {r for _, r in got}
    assert {r for r, _ in answered} == placed  # the router used both replicas
    assert len({n for _, n in answered}) == 2  # one replica per node (max_replicas_per_node=1)


def test_replica_killed_mid_run(cluster: str, engine: Engine) -> None:
    """Kill the replica serving a stream while 6 streams and 6 plain requests run. Streams on it end
    without `data: [DONE]` (the connection closes); plain requests on it answer 500, which the openai
    client retries on the survivor, so every plain request still gets its alone answer; the streams
    on the survivor finish whole; new requests are served at once; Ray Serve starts a replacement."""
    import ray
    from ray import serve

    before = _replicas()
    # each replica's process, found before the requests start so that freezing it costs no lookup through the GCS
    pids = {rid: ray._private.state.actors(_actor(rid)._actor_id.hex())["Pid"] for rid in before}
    n_tok = 900  # long enough to be mid-stream when the replicas are frozen (prompts are < 16 tokens, max_seq 1024)
    with Scheduler(engine, max_batch=1) as one_row:  # the same requests served alone, one after another
        alone = [one_row.generate(PROMPTS[i], n_tok, ignore_eos=True, **_sampling(i)).text for i in range(6)]
    started = threading.Barrier(7, timeout=T)
    outs: list[dict[str, Any]] = [{"text": "", "done": False, "error": None, "replica": None} for _ in range(6)]

    def stream(i: int) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": n_tok, "stream": True, "ignore_eos": True,
                **_sampling(i)}
        out = outs[i]
        try:
            with httpx.Client(timeout=T) as c, c.stream("POST", cluster + "/v1/completions", json=body) as r:
                out["replica"] = r.headers[REPLICA_HEADER]
                for k, line in enumerate(r.iter_lines()):
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        out["text"] += json.loads(line[6:])["choices"][0]["text"]
                    if k == 0:
                        started.wait()
        except httpx.HTTPError as e:
            out["error"] = e
        return out

    client = _client(cluster)  # the default max_retries=2: a 500 is retried

    def plain(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=n_tok,
                                         extra_body={"ignore_eos": True}, **_sampling(i)).choices[0].text

    with ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(stream, i) for i in range(6)]
        plains = [pool.submit(plain, i) for i in range(6)]
        started.wait()  # every stream has its first chunk
        # freeze both replicas at once, then choose as the victim one that still has a stream running: on a fast
        # machine a stream of the tiny model finished between its first chunk and a freeze that first looked up
        # the replica (CI, stops 19 and 21). What the frozen replicas had sent reaches the clients in the pause.
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        time.sleep(1.0)
        running = [o["replica"] for o in outs if not o["done"]]
        assert running, "every stream finished before the replicas were frozen"
        victim = outs[0]["replica"] if outs[0]["replica"] in running else running[0]
        for rid, pid in pids.items():
            if rid != victim:
                os.kill(pid, signal.SIGCONT)
        ray.kill(_actor(victim), no_restart=True)  # reaches the process through the GCS and its raylet
        killed_at = time.monotonic()
        s_results = [f.result(timeout=T) for f in streams]
        p_results = [f.result(timeout=T) for f in plains]

    on_victim = [i for i, r in enumerate(s_results) if r["replica"] == victim]
    cut = [i for i in on_victim if not s_results[i]["done"]]
    assert cut, "no stream was cut by the kill"
    for i in on_victim:  # a stream cut by the kill ends without [DONE]; one that ended before the freeze is whole
        r = s_results[i]
        if i in cut:
            assert isinstance(r["error"], httpx.RemoteProtocolError) and len(r["text"]) < len(alone[i])
        else:
            assert r["error"] is None and r["text"] == alone[i]
    for i, r in enumerate(s_results):
        if r["replica"] != victim:
            assert r["done"] and r["error"] is None and r["text"] == alone[i]
    assert p_results == alone

    survivor = next(k for k in before if k != victim)
    after = client.completions.with_raw_response.create(model=MODEL, prompt="def ", max_tokens=8, temperature=0)
    assert after.parse().choices[0].text == engine.generate("def ", 8).text
    deadline = killed_at + T
    while time.monotonic() < deadline:
        now = _replicas()
        status = serve.status().applications[APP_NAME].deployments["KvexportReplica"].replica_states
        if len(now) == 2 and victim not in now and status.get("RUNNING") == 2:
            break
        time.sleep(0.5)
    assert survivor in now and victim not in now and len(now) == 2, now
    replacement = next(k for k in now if k != survivor)
    seen: set[str] = set()

    def served_by(_: int) -> str:
        # a new connection for each request: both nodes' proxies listen on the one port (SO_REUSEPORT) and each
        # routes to the replica on its own node first, so requests kept alive on one connection all reach the
        # same proxy and, while it has room, the same replica (a CI run saw 120 s of bursts all go to the survivor)
        r = httpx.post(cluster + "/v1/completions", timeout=T, headers={"Connection": "close"},
                       json={"model": MODEL, "prompt": "x", "max_tokens": 64, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.headers[REPLICA_HEADER]

    # the router sends new requests to the replacement too, through the proxy on the replacement's node
    deadline = time.monotonic() + T
    with ThreadPoolExecutor(8) as pool:
        while replacement not in seen and time.monotonic() < deadline:
            seen.update(pool.map(served_by, range(16)))
    assert replacement in seen, seen

