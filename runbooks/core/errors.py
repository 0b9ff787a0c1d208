"""The one exception tree of cudamedic.

    CudamedicError
     +-- TargetError            something about the host or container we talk to
     |    +-- HostUnreachable   TCP connect / DNS / socket failure
     |    +-- AuthFailed        SSH authentication refused
     |    +-- HostKeyRejected   unknown or changed SSH host key
     |    +-- CommandTimedOut   a remote command ran past its timeout
     |    +-- ContainerNotFound no such container on the engine
     |    +-- EngineError       the Docker engine answered with an error
     +-- InputError             bad user input (names, paths, inventory, config)
     |    +-- NoSuchContainer   a named container does not exist on a host that answered
     +-- FixError               a fix could not be applied
          +-- FixLocked         another fix of that container holds its lock
          +-- VerifyFailed
          +-- RollbackFailed

paramiko and docker exceptions are translated at the edge (runbooks/collect/remote/), nowhere else.
"""

from __future__ import annotations


class CudamedicError(Exception):
    """Base of every error cudamedic raises on purpose."""


class TargetError(CudamedicError):
    pass


class HostUnreachable(TargetError):
    pass


class AuthFailed(TargetError):
    pass


class HostKeyRejected(TargetError):
    pass


class CommandTimedOut(TargetError):
    pass


class ContainerNotFound(TargetError):
    pass


class EngineError(TargetError):
    pass


class InputError(CudamedicError):
    pass


class NoSuchContainer(InputError):
    pass


class FixError(CudamedicError):
    pass


class FixLocked(FixError):
    """Another fix (or rollback) of the container holds its lock, here or on the target."""


class VerifyFailed(FixError):
    pass


class RollbackFailed(FixError):
    pass
