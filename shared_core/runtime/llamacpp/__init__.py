"""Runtimes other than torch. Each module gives an :class:`~shared_core.runtime.lm.LM` subclass with an
``open_session()`` whose session has :class:`shared_core.runtime.torch.session.KVSession`'s methods, so every
engine
runs on it unchanged; :func:`shared_core.runtime.models.load_lm` (``backend=``) is the one way to get one."""
