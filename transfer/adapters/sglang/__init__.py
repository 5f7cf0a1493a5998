"""kvferry as SGLang's PD transfer backend: ``--disaggregation-transfer-backend kvferry``.

SGLang loads the entry points of the group ``sglang.srt.plugins`` in every
process before it parses arguments; kvferry's (``kvferry =
transfer.adapters.sglang:register``) adds ``kvferry`` to the backend choices and
routes SGLang's ``get_kv_class`` to :mod:`.manager`, :mod:`.sender`,
:mod:`.receiver` and the bootstrap server in :mod:`.bootstrap`. No SGLang source
changes. Tested with the SGLang version pinned by the ``sglang`` extra.

Settings come from ``KVFERRY_*`` environment variables
(:func:`transfer.config.manager_config_from_env`), e.g. ``KVFERRY_PROTOCOL=tcp``
on hosts without RDMA; SGLang's own flags give the rest (bootstrap port,
host, TP/DP sizes, IB device).
"""

BACKEND = "kvferry"


def register() -> None:
    """The plugin entry point (idempotent); see :mod:`.plugin`."""
    from transfer.adapters.sglang.plugin import register as _register

    _register()
