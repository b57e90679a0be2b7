"""Unmodified scripts on an emulated GPU: ``vramplan run -- python train.py …``.

:mod:`.runner` runs the script under a trace session with phase/step hooks; :mod:`.device`
answers ``torch.cuda`` for the target GPU. The engine's :func:`vramplan.run_script` turns the
result into a :class:`~vramplan.results.MemoryReport`.
"""
