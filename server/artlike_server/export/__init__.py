"""Export a trained step for use outside this server: the PEFT adapter, merged Hugging Face weights, or GGUF.

    formats.py     what may be asked (format, dtype, GGUF quantisation), checked before any work
    source.py      a step in the data dir: its adapter directory, base model and history (no server needed)
    card.py        the model card (`README.md` with Hugging Face metadata) every export carries
    adapter.py     the `peft` format (no torch)
    merged.py      the `merged` format: base + adapter merged (torch)
    gguf_file.py   the `gguf` format, written with llama.cpp's gguf-py (torch)
    run.py         one export into a temporary directory beside the target, renamed into place at the end
    __main__.py    `python -m artlike_server.export`: the server runs exports in a child process (torch stays out)
    service.py, router.py, routes.py   the HTTP route that streams an export as a tar

The server process imports only formats, source, card, service and the routes (an import-linter contract).
"""
