"""Runtimes other than torch. Each module gives an :class:`~shared_core.lm.LM` subclass with an
``open_session()`` whose session has :class:`shared_core.kv.KVSession`'s methods, so every engine
runs on it unchanged; :func:`shared_core.models.load_lm` (``backend=``) is the one way to get one."""
