"""Services for the Streamlit app (pages/). Nothing in the engine imports them, and they never call st.*.

    jobs         one background pruning job at a time, and the run folders on disk
    recover_job  the Recover action on a finished run
    figures      plotly figures of a run; masks: the masks a page shows, as the run wrote them
    settings     the Prune page's form as data; compare: the Compare page's pieces
    deploy       a finished run as a zip or a GGUF; serving: who can reach the app
    checks       what the app checks before it trusts its environment; paths: typed paths kept under runs/"""
