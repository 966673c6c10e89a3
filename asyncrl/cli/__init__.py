"""The commands (`asyncrl ...`, `python -m asyncrl.cli ...`) and everything that reads a finished
or interrupted run dir: `main` (the parser and exit codes), `audit`, `inspect`, `plots`,
`export`, `eval`, `report` (the end-of-run summary). The top layer: nothing below imports it;
the trainer's `train()` returns and the command then writes the summary and the plots."""
