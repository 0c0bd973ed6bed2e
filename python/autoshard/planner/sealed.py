"""Plans are built, then sealed: what parallelize, the dry run, the checkpoints and the ranks'
agreement read is what the planner decided and nothing wrote later. A plan that should differ
is made again (autoshard.plan with overrides), or read from an edited JSON document."""

import copy


class Sealed:
    """A part of a plan whose attributes cannot be set once `_seal` has run."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_sealed"):
            raise AttributeError(f"{type(self).__name__}.{name}: a plan cannot be changed once it is built; make "
                                 "another with autoshard.plan (overrides= keeps layers whole or gathered), or read "
                                 "an edited document with ShardingPlan.from_json")
        object.__setattr__(self, name, value)

    def _seal(self) -> None:
        object.__setattr__(self, "_sealed", True)


def _refuse(self, *args, **kwargs):
    raise AttributeError("a plan's lists cannot be changed once it is built; make another with autoshard.plan, or "
                         "read an edited document with ShardingPlan.from_json")


class SealedList(list):
    """A sealed plan's list: equal to (and read as) the list it was, with no way to change it."""

    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce_ex__(self, protocol):
        return SealedList, (list(self),)

    def __deepcopy__(self, memo):
        return SealedList(copy.deepcopy(list(self), memo))
