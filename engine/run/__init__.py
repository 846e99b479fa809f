"""The run: its loop (loop.PruneRun), what it is made of (resources.RunResources, frozen once loaded, and
resources.LoopState, what the loop sets as it goes), its state (state.RunState, the checkpoint's content), the
masks it takes from its scores, its start (initialise; mix: the joint method's starting mix scored on the run's model), its
checkpoints, its folder (folder) and file names (files), its plan and phases, and results.json. The algorithm
packages (algo/, model/) import none of it at run time (methods/base.py names RunState in its type hints only)."""
