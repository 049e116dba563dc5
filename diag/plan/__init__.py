"""The plan: what will run where, decided before anything runs.

Suite files (`suite`), user functions as suite entries (`suite_fn`), cases and their seeded
inputs (`cases`, `inputs`), the op modules found under probes/ (`registry`, `probe`). The
runner reads what this stage decides; nothing here imports a framework or a later stage.
"""
