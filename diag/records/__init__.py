"""Records: what a run leaves on disk, and the one way to read it back.

`results` holds `Record` and `RunDir` (append + fsync, atomic run.json), `results_file`
reads results.jsonl back (tolerating one torn last line), `run_meta` is run.json's schema,
`outputs` checks where outputs may be written. Later stages (gate, report) read only this.
"""
