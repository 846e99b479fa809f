"""Chat: the dense model and the pruned model (and the recovered one, where the run has it) answer the same prompt,
side by side, streamed."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for _ui, beside this page
import _ui  # noqa: E402
import streamlit as st  # noqa: E402

from engine.tools.chat import (MIN_SPEED_TOKENS, PROMPTS_FILE, GenerationSettings, masked_from_run,  # noqa: E402
                               prompt_problem, recovered_folder, saved_prompts, speed_comparison, stream)
from engine.errors import UserError  # noqa: E402
from engine.tools.recover import recovery_words_of  # noqa: E402

st.title(":material/forum: Chat: dense vs pruned")
st.markdown("The models answer the same prompt, one after the other (dense first), streamed token by token; a run "
            "with a recovered model (`prune --recover`) adds it in a third column. "
            "Each prompt is answered on its own, without the earlier turns. Both sides run in the **same backend** "
            "(transformers beside transformers, llama.cpp beside llama.cpp), so their tokens/s compare.")

finished = [r for r in _ui.runs() if r.results and r.has_masks]
if not finished:
    st.info("No finished run yet. Finish a run on **Prune** (or load one on **Runs**) to chat with its pruned model.")
    st.stop()

paths = [str(r.path) for r in finished]
current = _ui.selected_run()
index = paths.index(current) if current in paths else 0
run = st.selectbox("Pruned run", finished, index=index, format_func=_ui.run_label,
                   help="A finished run of the Prune page (its masks and sliced export).")
MODES = {  # the first is the default: the exported model, as a user would deploy it
    "sliced": "Sliced export (the exported model: refit, physically smaller)",
    "gguf": "GGUF in llama.cpp (the deployable file)",
    "masked": "Masks only, no refit (the base model's weights)",
}
MASKED_NO_SPEEDUP = ("Masks only, no refit: no speed-up to show (the masks still compute every weight, and the "
                     "answer is not the exported model's, which is refit). Choose the sliced export or the GGUF.")
mode = st.radio("Pruned model", list(MODES), format_func=MODES.get, horizontal=True,
                help="Sliced (the default): the run's exported model, refit and physically smaller, as a user "
                     "deploys it; it shows the real speed-up. "
                     "Masks only: the dense weights with the pruned units zeroed by hooks, without the refit (so its "
                     "answer can differ from the export's); one copy of the weights serves both columns. "
                     "GGUF: the run's model.gguf (written by `prune --export-gguf`, or exported here as f16 the first "
                     "time) in llama.cpp, as a user would deploy it; the dense side is then the dense model as a GGUF "
                     "of the same type in llama.cpp too (converted once, kept beside the runs), so both tokens/s are "
                     "llama.cpp's.")
recovered = recovered_folder(run.path) if mode == "sliced" else None
with_recovered = recovered is not None and st.toggle(
    "Also the recovered model", value=True, key="chat-recovered",
    help="The run's export after recovery (RUN/recover/model: `prune "
         "--recover MINUTES`, or `recover RUN --out RUN/recover`), in a third column, in the same backend.")
with st.expander("Generation settings (shared by every column)", expanded=False):
    g1, g2, g3 = st.columns(3)
    max_new = g1.slider("Max new tokens", 8, 512, 64, 8)
    greedy = g2.toggle("Greedy", value=True, help="Deterministic: always the most likely token.")
    temperature = g3.slider("Temperature", 0.05, 1.5, 0.7, 0.05, disabled=greedy)
settings = GenerationSettings(max_new_tokens=int(max_new), temperature=float(temperature), greedy=bool(greedy))

history_key = "chat_history"
history = st.session_state.setdefault(history_key, [])


def stats_line(stats, model) -> str:
    """Under an answer: its tokens, its decoding speed (after the first token, on a warmed-up model; not shown
    under MIN_SPEED_TOKENS tokens), the backend and the parameters."""
    threads = model.info.get("threads")  # (llama.cpp's own thread count; transformers' is torch's)
    tps = stats.decode_tokens_per_s
    speed = f"{tps:.1f} tokens/s" if tps else f"tokens/s not shown (under {MIN_SPEED_TOKENS} tokens)"
    return (f"{stats.new_tokens} tokens · {speed} in {model.backend} · "
            f"{_ui.fmt_params(model.params)} parameters" + (f" · {threads} threads" if threads else ""))


def show_turn(turn: dict) -> None:
    with st.chat_message("user"):
        st.markdown(turn["prompt"])
    sides = [side for side in ("dense", "pruned", "recovered") if side + "_label" in turn]
    for col, side in zip(st.columns(len(sides)), sides):
        with col:
            st.markdown(f"**{turn[side + '_label']}**")
            st.markdown(turn[side] or "*(empty answer)*")
            st.caption(turn[side + "_stats"])
    if turn.get("speedup"):
        st.info(turn["speedup"], icon=":material/speed:")


for turn in history:
    show_turn(turn)

def load_models():
    """(dense, pruned, recovered or None) ChatModels of the chosen mode, or None after saying why they cannot load."""
    try:
        if mode == "gguf":  # llama.cpp on both sides: the run's GGUF, and the dense model's of the same type
            pruned = _ui.gguf_model(str(run.path), run.modified)  # (first: the dense GGUF takes its weight type)
            return _ui.dense_gguf_model(str(run.path), run.modified), pruned, None
        dense = _ui.base_model(run.config["model"], run.config.get("dtype", "float32"))
        if mode == "masked":
            return dense, masked_from_run(dense, run.path), None
        third = (_ui.recovered_model(str(run.path), (recovered / "config.json").stat().st_mtime)
                 if with_recovered else None)
        return dense, _ui.sliced_model(str(run.path), run.modified), third
    except (UserError, OSError) as e:
        st.error(f"Cannot load the models: {e}")
        return None


def answer(prompt: str, dense, pruned, third=None) -> None:
    """One prompt answered by each model side by side (dense first), streamed, and kept in the history."""
    with st.chat_message("user"):
        st.markdown(prompt)
    turn = {"prompt": prompt}
    columns = [("dense", dense, f"Dense · {Path(run.config['model']).name} · {dense.backend}"),
               ("pruned", pruned, f"Pruned · {MODES[mode].split(' (')[0]} · {pruned.backend}")]
    if third is not None:
        columns.append(("recovered", third, f"Recovered · {recovery_words_of(recovered.parent)} · {third.backend}"))
    tps = {}
    for col, (side, model, label) in zip(st.columns(len(columns)), columns):
        with col:
            st.markdown(f"**{label}**")
            try:
                gen = stream(model, prompt, settings)
                text = st.write_stream(gen)
                stats = stats_line(gen.stats, model)
                tps[side] = gen.stats.decode_tokens_per_s
            except UserError as e:
                st.error(str(e))
                text, stats = "", f"failed: {e}"  # (the turn keeps its reason)
            st.caption(stats)
        turn.update({side: text if isinstance(text, str) else "".join(map(str, text)), side + "_stats": stats,
                     side + "_label": label})
    if mode == "masked":
        turn["speedup"] = MASKED_NO_SPEEDUP
        st.info(turn["speedup"], icon=":material/speed:")
    elif "dense" in tps and "pruned" in tps:  # (the recovered model has the pruned one's shapes: its speed too)
        turn["speedup"] = speed_comparison(dense.backend, tps["dense"], pruned.backend, tps["pruned"])
        st.info(turn["speedup"], icon=":material/speed:")
    history.append(turn)


saved = saved_prompts()
run_set = st.button(f"Run the saved prompt set ({len(saved)} prompts)", icon=":material/playlist_play:",
                    disabled=not saved, help=f"Each prompt of {PROMPTS_FILE.relative_to(PROMPTS_FILE.parents[1])}, "
                                             "answered by each model side by side, one after the other.")
prompt = st.chat_input("Ask the models…")
if prompt is not None and (empty := prompt_problem([], prompt, settings.max_new_tokens)):
    st.warning(f"Not sent: {empty}.", icon=":material/block:")
    prompt = None
asked = saved if run_set else [prompt] if prompt else []
if asked:
    models = load_models()
    if models is None:
        st.stop()
    dense, pruned, third = models
    for p in asked:
        if too_long := prompt_problem([m for m in models if m is not None], p, settings.max_new_tokens):
            st.error(f"Not sent: {too_long}.", icon=":material/block:")
            continue
        answer(p, dense, pruned, third)

if history and st.button("Clear the conversation"):
    st.session_state[history_key] = []
    st.rerun()
