"""DRAFT (issue 67 §3): chapter 20's lab, to move into mini_moe/labs/catalogue.py (the section) and
tests/test_labs.py (WRONG["ch20.reap_saliency"]) when chapter 20 enters the book (the hint names its
section, and tests/test_labs.py checks that every hint resolves)."""

# ---- catalogue section ------------------------------------------------------------------------

def _reap_reference(gates, routed, outputs):
    """The library's REAP saliency (:func:`mini_moe.compress.saliency`, ``"reap"``)."""
    from mini_moe import compress  # here, not at the top: compress imports the model

    m, e = np.shape(routed)
    record = compress.LayerRecord(inputs=np.zeros((m, 1)), logits=np.zeros((m, e)), probs=np.zeros((m, e)),
                                  gates=np.asarray(gates), routed=np.asarray(routed, bool), outputs=np.asarray(outputs))
    return compress.saliency(record, "reap")


def _reap_cases(rng):
    """Calibration records of one layer: M tokens, E experts, outputs of width D; a token's gates
    are zero where it was not routed (as :func:`mini_moe.compress.calibrate` records them)."""
    def case(label, m, e, d, k=1, routed=None, outputs=None, scale=1.0):
        logits = rng.normal(size=(m, e)) * 2
        probs = _softmax(logits)
        if routed is None:
            top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
            routed = np.zeros((m, e), bool)
            np.put_along_axis(routed, top, True, axis=-1)
        outputs = (rng.normal(size=(m, e, d)) * scale).astype(np.float32) if outputs is None else outputs
        return label, {"gates": np.where(routed, probs, 0).astype(np.float32), "routed": np.asarray(routed, bool),
                       "outputs": np.asarray(outputs, np.float32)}

    unused = np.zeros((5, 3), bool)
    unused[:, 0] = True
    unequal = np.zeros((6, 2), bool)
    unequal[:5, 0] = True
    unequal[5, 1] = True
    cases = [case("one token, one expert", 1, 1, 3),
             case("an expert no token reached", 5, 3, 4, routed=unused),
             case("one expert gets five tokens, the other one", 6, 2, 3, routed=unequal),
             case("width 1 (the norm is an absolute value)", 6, 3, 1),
             case("k = 2", 8, 4, 5, k=2),
             case("outputs of zero", 4, 3, 2, outputs=np.zeros((4, 3, 2))),
             case("large outputs", 6, 3, 4, scale=1e4)]
    return cases + [case(f"random {i}", int(rng.integers(2, 40)), int(rng.integers(2, 9)), int(rng.integers(1, 9)),
                         k=int(rng.integers(1, 3))) for i in range(6)]


register(Lab(
    name="ch20.reap_saliency",
    axes=(("expert",),),
    signature="(gates, routed, outputs)",
    doc="REAP's saliency of each expert (Lasby et al. 2025; chapter 20): gates [M, E] (the combine weight of "
        "expert e's output in token t's output, 0 where e did not process t), routed bool [M, E] (which tokens "
        "each expert processed), outputs [M, E, D] (every expert's output on every token) -> scores [E]: for each "
        "expert, the mean over the tokens it processed of its gate times the Euclidean norm of its output; "
        "0 for an expert that processed no token.",
    reference=_reap_reference,
    cases=_reap_cases,
    properties=(("a negative score", lambda kw, out: bool(np.all(np.asarray(out) >= 0))),
                ("a nonzero score for an expert that processed no token",
                 lambda kw, out: bool(np.all(np.where(np.asarray(kw["routed"]).any(0), 0, np.asarray(out)) == 0)))),
    hint="chapter 20, 'What pruning does to eq. (2)': over which tokens does REAP average, and which norm of "
         "which output does it weight by the gate?",
))

# ---- tests/test_labs.py: WRONG["ch20.reap_saliency"] -------------------------------------------


def _reap(gates, routed, outputs, *, gate=True, over="routed", norm=2, axis=-1, squared=False, total=False,
          product_of_means=False, guard=True):
    g, r, o = np.asarray(gates, np.float64), np.asarray(routed, float), np.asarray(outputs, np.float64)
    n = np.linalg.norm(o, ord=norm, axis=axis) if axis == -1 else np.linalg.norm(o, axis=1)[:, None].repeat(r.shape[1], 1)
    n = n ** 2 if squared else n
    if product_of_means:
        count = np.maximum(r.sum(0), 1)
        return (r * g).sum(0) / count * (r * n).sum(0) / count
    contribution = r * (g * n if gate else n)
    if total:
        return contribution.sum(0)
    count = r.sum(0)
    return contribution.sum(0) / (len(r) if over == "all" else np.maximum(count, 1) if guard else count)


WRONG_REAP = [
    lambda gates, routed, outputs: _reap(gates, routed, outputs, gate=False),  # forgets the gate (EAN)
    lambda gates, routed, outputs: _reap(gates, routed, outputs, over="all"),  # the mean over all tokens
    lambda gates, routed, outputs: _reap(gates, routed, outputs, squared=True),  # the squared norm
    lambda gates, routed, outputs: _reap(gates, routed, outputs, norm=1),  # the L1 norm
    lambda gates, routed, outputs: _reap(gates, routed, outputs, total=True),  # the sum, not the mean
    lambda gates, routed, outputs: _reap(gates, routed, outputs, product_of_means=True),  # mean gate x mean norm
    lambda gates, routed, outputs: _reap(gates, routed, outputs, axis=1),  # the norm across experts
    lambda gates, routed, outputs: _reap(gates, routed, outputs, guard=False),  # 0 / 0 for an unused expert
]
