"""A 32k-token request on the 1B-shaped file: pagoda serve --max-model-len 32768, the prompt
chunked, then a second request sharing all but its last 100 tokens (the prefix cache), RSS of
the server's processes after each."""
import json, os, random, subprocess, sys, time
import httpx, psutil

MODEL = "/tmp/models/llama-1b-q4_k_m.gguf"
PORT = 18901
out = {}

def tree_rss(pid):
    p = psutil.Process(pid)
    procs = [p] + p.children(recursive=True)
    return sum(q.memory_info().rss for q in procs if q.is_running()), {q.name(): q.memory_info().rss for q in procs}

rng = random.Random(0)
prefix = [rng.randrange(1000, 40000) for _ in range(31900)]
tail1 = [rng.randrange(1000, 40000) for _ in range(100)]
tail2 = [rng.randrange(1000, 40000) for _ in range(100)]

srv = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", MODEL, "--host", "127.0.0.1",
                        "--port", str(PORT), "--max-model-len", "32768"], stdout=open("/tmp/lc32k/pagoda.log", "w"),
                       stderr=subprocess.STDOUT, cwd="/work/main")
try:
    c = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=3600)
    for _ in range(300):
        try:
            if c.get("/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    out["rss_after_start"] = tree_rss(srv.pid)
    for name, ids in (("first", prefix + tail1), ("second", prefix + tail2)):
        t0 = time.time()
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 16, "temperature": 0,
                                             "ignore_eos": True})
        r.raise_for_status()
        body = r.json()
        out[name] = {"seconds": time.time() - t0, "usage": body["usage"], "rss": tree_rss(srv.pid)}
        print(name, json.dumps(out[name]), flush=True)
finally:
    srv.terminate()
    srv.wait(60)
json.dump(out, open("/tmp/lc32k/result.json", "w"), indent=1)
print(json.dumps(out, indent=1))
