"""The exploration app: `streamlit run app.py`.

Pages: Prune (live run), Compare (global vs uniform), Chat (dense vs pruned), Runs (on disk).
The pages are thin; the work is in engine/ (jobs.py, chat.py, figures.py).
"""

import os

import streamlit as st

from engine.ui.serving import exposure_warning, log_once

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

st.set_page_config(page_title="Policy-gradient pruning", page_icon="✂️", layout="wide")

if exposed := exposure_warning(st.get_option("server.address")):  # (started with --server.address 0.0.0.0)
    st.warning(exposed, icon=":material/public:")
    log_once(exposed)

# A narrower sidebar on a narrow window (its links are four short page names; Streamlit's 300 px took 30 % of a
# 1000 px window, and cut the pages' buttons)
st.html("<style>@media (max-width: 1280px) { section[data-testid='stSidebar'] "
        "{ width: 200px !important; min-width: 200px !important; } }</style>")

pages = [
    st.Page("pages/prune.py", title="Prune", icon=":material/content_cut:", default=True),
    st.Page("pages/compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("pages/chat.py", title="Chat", icon=":material/forum:"),
    st.Page("pages/runs.py", title="Runs", icon=":material/folder_open:"),
]
st.navigation(pages).run()
