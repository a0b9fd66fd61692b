//! `HiddenRows`: the target's hidden states that a proposer declared
//! (`Capabilities::hidden_layers`), for consecutive positions, as the
//! verify stage records them, the scheduler buffers them per sequence and
//! the draft stage hands them over.
//!
//! Invariants: every layer block holds the same number of rows, in
//! position order; trimming drops the oldest rows of every layer alike and
//! moves the caller's start position past them.

/// Most rows of hidden states a sequence buffers for its proposer between
/// two drafting steps. A sequence whose proposer is paused (the policy
/// stopped drafting) or that has a long prompt would otherwise hold every
/// position's features (7 KB per position for an EAGLE-3 head on the
/// default model); the proposers' catch-ups read at most their `window`
/// (256 by default) of the newest anyway. A buffer past a quarter more
/// than the cap is cut back to the newest `max_hidden_rows`. Plugins see
/// where the rows start (`hidden_start`), which then skips the dropped
/// positions.
pub const MAX_HIDDEN_ROWS: usize = 4096;

/// One `(target hidden index, rows x width values)` block per declared
/// layer, in declaration order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HiddenRows(pub Vec<(usize, Vec<f32>)>);

impl std::ops::Deref for HiddenRows {
    type Target = [(usize, Vec<f32>)];
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl From<Vec<(usize, Vec<f32>)>> for HiddenRows {
    fn from(v: Vec<(usize, Vec<f32>)>) -> Self {
        Self(v)
    }
}

impl FromIterator<(usize, Vec<f32>)> for HiddenRows {
    fn from_iter<I: IntoIterator<Item = (usize, Vec<f32>)>>(it: I) -> Self {
        Self(it.into_iter().collect())
    }
}

impl HiddenRows {
    /// Rows held, given the row width.
    pub fn rows(&self, width: usize) -> usize {
        self.0
            .first()
            .map_or(0, |(_, v)| v.len().checked_div(width).unwrap_or(0))
    }

    /// Append `more` (the rows right after these) layer by layer.
    pub fn extend(&mut self, more: HiddenRows) {
        if self.0.is_empty() {
            *self = more;
            return;
        }
        for ((have_l, have), (l, new)) in self.0.iter_mut().zip(more.0) {
            if *have_l == l {
                have.extend_from_slice(&new);
            }
        }
    }

    /// Keep only the newest `max` of the `held` rows of every layer
    /// (rows from position `*start`), moving `*start` past the dropped
    /// ones.
    pub fn trim(&mut self, start: &mut usize, held: usize, max: usize) {
        if held <= max {
            return;
        }
        let drop = held - max;
        for (_, v) in self.0.iter_mut() {
            let width = v.len() / held;
            v.drain(..(drop * width).min(v.len()));
        }
        *start += drop;
    }

    /// Rows `rows` (indices into the `fed` rows of every layer), in that
    /// order: what a verify's accepted path keeps.
    pub fn pick(self, rows: &[usize], fed: usize) -> HiddenRows {
        HiddenRows(
            self.0
                .into_iter()
                .map(|(l, h)| {
                    let width = h.len() / fed.max(1);
                    let mut v = Vec::with_capacity(width * rows.len());
                    for &row in rows {
                        if let Some(x) = h.get(row * width..(row + 1) * width) {
                            v.extend_from_slice(x);
                        }
                    }
                    (l, v)
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(l: usize, from: usize, n: usize) -> (usize, Vec<f32>) {
        // Width 2: row r holds [r, r].
        (l, (from..from + n).flat_map(|r| [r as f32; 2]).collect())
    }

    #[test]
    fn extend_trim_and_pick_keep_layers_in_step() {
        let mut h = HiddenRows(vec![rows(3, 0, 3), rows(7, 0, 3)]);
        h.extend(HiddenRows(vec![rows(3, 3, 2), rows(7, 3, 2)]));
        assert_eq!(h.rows(2), 5);
        let mut start = 10;
        h.trim(&mut start, 5, 2);
        assert_eq!(start, 13);
        assert_eq!(h.0, vec![rows(3, 3, 2), rows(7, 3, 2)]);
        // Under the cap nothing moves.
        h.trim(&mut start, 2, 4);
        assert_eq!(start, 13);
        let picked = HiddenRows(vec![rows(3, 0, 4)]).pick(&[0, 2, 3], 4);
        assert_eq!(picked.0, vec![(3, vec![0.0, 0.0, 2.0, 2.0, 3.0, 3.0])]);
    }

    #[test]
    fn buffered_hidden_rows_keep_the_newest_and_move_their_start() {
        // Two layers of width 2, rows for positions 10..16.
        let rows = |r: std::ops::Range<usize>, l: f32| -> Vec<f32> {
            r.flat_map(|p| [l + p as f32, l + p as f32 + 0.5]).collect()
        };
        let mut h = HiddenRows(vec![(3, rows(10..16, 0.0)), (7, rows(10..16, 100.0))]);
        let mut start = 10;
        h.trim(&mut start, 6, 8);
        assert_eq!((start, h[0].1.len()), (10, 12), "under the cap: untouched");
        h.trim(&mut start, 6, 4);
        assert_eq!(start, 12);
        assert_eq!(h[0], (3, rows(12..16, 0.0)));
        assert_eq!(h[1], (7, rows(12..16, 100.0)));
    }
}
