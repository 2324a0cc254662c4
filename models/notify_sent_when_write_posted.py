"""P sends D the completion notification when it posts the write, before the data has landed.

Reproduces ai-dynamo/nixl#252 ("UCX: Only send request notification when
requests have completed"): the UCX backend sent a request's notification
once the write was posted and flushed, but a flush does not fence the data
at the target, so the notification could reach D before the KV did (worse
with several lanes or weaker ordering).  The reference sends ``notify`` from
the transfer's completion handler only; this mutant's P treats the write as
complete when it posts it and notifies D at once, so D commits while the
transfer is still writing.  Family: push.  Caught as ``commit-before-ready``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, MsgKind, XferState

PROJECT = "nixl"
LINKS = ("https://github.com/ai-dynamo/nixl/pull/252",)
FAMILY = "push"
FAULTS = ()
EXPECTED = "commit-before-ready"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1)


def prefill_done_notify_on_post(m, s, r, q, ev):
    s = REFERENCE[m.policy].prefill_done.effect(m, s, r, q, ev)
    if m.xfer_of(s, r) < 0:
        return s  # pull: P posts no write (D reads later)
    # BUG: posted (and flushed) is taken for completed: notify D now, not when the write lands
    q = s.reqs[r]._replace(xs=XferState.DONE)
    return m.send(m.set_req(s, r, q), MsgKind.NOTIFY, r, q.gen, q.p, q.d)


class NotifySentWhenWritePosted(HandoffModel):
    name = "notify_sent_when_write_posted"
    rules = REFERENCE.replace("prefill_done", effect=prefill_done_notify_on_post)


def build(config: ModelConfig) -> HandoffModel:
    return NotifySentWhenWritePosted(config)
