"""The node.meta keys autojigsaw's passes write, in one place.

On the captured graph, strategies.annotate writes STRATEGIES. On a rewritten graph, the
rewrite writes PLACEMENTS, GLOBAL and ORIGIN on every node and AXIS on every collective.
"""

STRATEGIES = "autojigsaw_strategies"  # captured node: list[Strategy], its legal ways to run
PLACEMENTS = "autojigsaw_placements"  # rewritten node: tuple of its outputs' placements
GLOBAL = "autojigsaw_global"  # rewritten node: the global fake value(s) it holds a shard of
ORIGIN = "autojigsaw_origin"  # rewritten node: name of the captured node it serves
AXIS = "autojigsaw_axis"  # rewritten collective: index of the mesh axis it works on
