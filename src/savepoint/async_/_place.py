"""Where the writer process of ``AsyncCheckpointer(writer="process")`` writes: a save's location
(and an incremental save's blob store) named by a URL the writer process resolves to the same
store and path.

The writer process is another interpreter: it cannot use the trainer's store objects, only make
its own, and what it can make is what :func:`savepoint.storage.paths.resolve` makes of a URL:

- the local filesystem (an absolute path);
- the object store of a scheme (``s3://``, ``gs://``, ``az://``: obstore's, configured from the
  environment, which the writer process inherits from its trainer: endpoint, region and
  credentials alike, so nothing secret is put on a command line or sent on the socket);
- fsspec's filesystem of a URL (``hdfs://``, ``sftp://``, ``fsspec+file://``, ...: what the URL
  says, plus fsspec's configuration from the environment).

A location is accepted when resolving its URL here, in the trainer, gives the very store it is
in (a store made from a URL: ``sp.save("s3://...")``, a run opened on a URL); the writer process
then makes the same store from the same URL and environment. Refused with an
:class:`~savepoint.errors.UnsupportedStorageError` (a ValueError) naming what to do instead:

- ``memory://`` (savepoint's in-memory stores, and fsspec's ``memory`` filesystem): the memory
  of the trainer's process, which the writer process does not share;
- a store made by hand (an ``ObjectStore`` given keyword options, an ``FsspecStore`` around a
  filesystem object, a fault-injecting wrapper), or one whose URL held what its shown URL
  leaves out (an ``sftp://user:password@host`` password): its configuration is in objects of
  the trainer's process; name it by a URL, with its configuration in the environment, or use
  the thread writer.
"""

from __future__ import annotations

import os

from savepoint.errors import UnsupportedStorageError
from savepoint.storage.local import LocalStore
from savepoint.storage.paths import Location, resolve

__all__ = ["url_of"]


def url_of(location: Location, what: str) -> str:
    """The URL the writer process resolves to ``location`` (see the module docstring); raises
    UnsupportedStorageError for a location it cannot reach. Connects nowhere."""
    store = location.store
    if type(store) is LocalStore:
        return os.path.abspath(location.path)
    shown = store.url(location.path)
    if "memory" in store.scheme.split("+"):
        raise UnsupportedStorageError(
            f"writer='process' cannot write the {what} {shown}: an in-memory store lives in "
            "this process, which the writer process does not share; give writer='thread' "
            "(AsyncCheckpointer or CheckpointManager), or no writer= (the default falls back "
            "to the thread writer for it)",
            path=shown,
            scheme=store.scheme,
        )
    try:
        again = resolve(shown, what=what)
    except UnsupportedStorageError:
        again = None
    if again is None or again.store is not store or again.path != store.abspath(location.path):
        raise UnsupportedStorageError(
            f"writer='process' cannot write the {what} {shown}: its store cannot be made "
            "again from that URL (a store made by hand, or one whose URL held a password): "
            "the writer process writes local paths and stores named by a URL (s3://, gs://, "
            "az://, fsspec's), configured from the environment it inherits; pass such a URL, "
            "or give writer='thread' (or no writer=: the default falls back to it)",
            path=shown,
            scheme=store.scheme,
        )
    return shown
