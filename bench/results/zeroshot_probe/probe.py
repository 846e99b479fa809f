"""fp32 vs bf16-autocast (fp32 head) zero-shot on the first N docs per task; one thread. argv: model_dir N dtype out"""
import json, sys, time, os, torch
sys.path.insert(0, "/work/main/bench")
torch.set_num_threads(1)
from engine.loading import load_model, resolve_model
from reward_study import zeroshot_docs
from confirm import ZEROSHOT_TASKS
model_dir, n, dtype, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
model, tok = load_model(resolve_model(model_dir)); model.eval()
if dtype == "bfloat16":
    head = model.get_output_embeddings()
    fwd = head.forward
    def fp32_head(x):
        with torch.autocast("cpu", enabled=False):
            return fwd(x.float())
    head.forward = fp32_head
ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else torch.autocast("cpu", enabled=False)
t0 = time.process_time()
with torch.no_grad(), ctx:
    s = zeroshot_docs(model, tok, {t: list(range(n)) for t in ZEROSHOT_TASKS})
json.dump({"scores": s, "cpu_seconds": time.process_time() - t0}, open(out, "w"))
print(dtype, {t: v.count("1") / len(v) for t, v in s.items()}, time.process_time() - t0)
