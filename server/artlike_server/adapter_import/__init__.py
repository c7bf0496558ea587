"""Import a PEFT LoRA adapter trained elsewhere (TRL, Unsloth, plain PEFT) on this server's base as a new step
of a model, created when it does not exist: served at once as `name@N`, then rated, trained on or exported
like any step.

    check.py     is the adapter servable and trainable here (files, config, base, rank, dtype)? no torch
    steps.py     the checked adapter written as a step directory, its history line, and whether it fits an
                 existing model
    archive.py   the adapter directory as an uncompressed tar (what the route receives) and back
    offline.py   the import into a data dir no server is running on, under the data dir's lock
    cli_run.py   what `artlike import` does: through a running server, or into the data dir
    service.py, router.py, routes.py   `POST /v1/trainable_models/{name}/steps/import` on a running server
"""
