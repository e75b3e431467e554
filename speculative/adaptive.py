"""Adaptive draft length and pausing, shared by the model-based draft sources."""


class AdaptiveLength:
    """How many tokens to draft next, learned from how the last drafts fared.

    +2 after a fully accepted draft, -1 otherwise, within [1, max_draft]. Drafting pauses
    while the first draft token is accepted less often than drafting and verifying it costs
    (``draft_token_cost``, as a fraction of a target step), probing after 1, 2, 4 ... skipped steps.

    Args:
        num_draft: the length to start with (and the fixed length when not ``enabled``).
        max_draft: the longest draft.
        draft_token_cost: the break-even first-token acceptance.
        enabled: False keeps ``num_draft`` fixed and never pauses.
    """

    FORGET = 0.8  # weight of the past in the acceptance estimate: about the last 5 drafts count
    MAX_PROBE_GAP = 64

    def __init__(self, num_draft: int, max_draft: int, draft_token_cost: float, enabled: bool = True):
        self.max_draft = max(max_draft, num_draft)
        self.draft_token_cost = draft_token_cost
        self.enabled = enabled
        self.initial_num_draft = num_draft
        self.reset()

    def reset(self):
        """Start over, as for a new generation."""
        self.num_draft = self.initial_num_draft
        self.first_accepted, self.drafts = 1.0, 2.0  # prior: the first token is accepted half the time
        self.accepted, self.proposed = 1.0, 2.0  # tokens per draft (same weights): one drafted, half accepted
        self.skipped, self.probe_gap = 0, 1

    def paused(self) -> bool:
        """Skip this step's draft? (Counts the skip; the caller must then not draft.)"""
        if not self.enabled or self.first_accepted / self.drafts > self.draft_token_cost:
            return False
        self.skipped += 1
        if self.skipped <= self.probe_gap:
            return True
        self.skipped, self.probe_gap = 0, min(2 * self.probe_gap, self.MAX_PROBE_GAP)
        return False

    def record(self, num_proposed: int, num_accepted: int):
        if not num_proposed or not self.enabled:
            return
        self.first_accepted = self.FORGET * self.first_accepted + (num_accepted > 0)
        self.drafts = self.FORGET * self.drafts + 1
        self.accepted = self.FORGET * self.accepted + num_accepted
        self.proposed = self.FORGET * self.proposed + num_proposed
        if num_accepted:
            self.probe_gap = 1
        if num_accepted == num_proposed:
            self.num_draft = min(self.num_draft + 2, self.max_draft)
        else:
            self.num_draft = max(self.num_draft - 1, 1)

    def expected_speedup(self) -> float:
        """What the next draft is expected to give, from the recent ones: tokens emitted per
        plain step's time, (1 + accepted per draft) / (1 + cost of the tokens drafted per draft)."""
        accepted, proposed = self.accepted / self.drafts, self.proposed / self.drafts
        return (1 + accepted) / (1 + self.draft_token_cost * proposed)
