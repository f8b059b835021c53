"""The kernel as torpor uses it itself, shared by the adapters: one module per job.

:mod:`~.procfs` reads processes in /proc, :mod:`~.sockets` the sockets they hold; :mod:`~.ownprocess` is
what a torpor process asks for itself (namespaces, ``prctl``, its cgroup, CPUs kept awake);
:mod:`~.private` creates torpor's own files and folders, private and never through a link;
:mod:`~.disk` is the page cache and durability under the store's files; :mod:`~.mounts` mounts the hot
tier's tmpfs; :mod:`~.machine` describes the machine for ``torpor doctor``; :mod:`~.libc` is the C library
the others call (the system calls Python 3.11 lacks). The package exports nothing itself: importers name
the module they use.
"""
