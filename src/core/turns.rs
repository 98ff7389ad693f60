//! Fair turns across the tenants of a role among starts waiting for capacity (0.7.0):
//! the order of the line that waiters.rs keeps in shared memory, as plain values.
//!
//! A waiter's turn is fixed when it takes its place: one past its tenant's last
//! waiter's, and no earlier than the turn of the role's first waiter still in line. The
//! line goes by turn, then by place (arrival). So a tenant that queued many starts holds
//! one turn per start, while a tenant that arrives later with one start gets the turn
//! of the front of the line: it goes after the waiters that already hold that turn and
//! before the second turn of any tenant.

/// The turn of a new waiter, given the front turn of its role's line (None: nobody
/// waits) and its tenant's last waiter's turn (None: none of its tenant waits).
pub fn next_turn(front: Option<u64>, tenant_last: Option<u64>) -> u64 {
    let front = front.unwrap_or(0);
    match tenant_last {
        Some(last) => front.max(last.saturating_add(1)),
        None => front,
    }
}

/// The front turn of a role's line: the first turn of the waiters refused by the
/// role's limit whose request is not in flight (`line`), else the first turn of any of
/// the role's waiters (`any`), so that it never falls back behind waiters that were
/// held apart for a moment (by their tenant's own limit, the database cap).
pub fn front(line: Option<u64>, any: Option<u64>) -> Option<u64> {
    line.or(any)
}

/// The turn of a waiter of the same tenant as a waiter at `left` that leaves the line
/// without being admitted (it timed out, or was cancelled): the later ones move up one
/// turn, so that the turns a tenant's waiters gave up are not kept from it, but never
/// before `floor`, the front when it joined (its tenant's turns may have gaps, and the
/// other tenants' waiters that were in line then stay ahead).
pub fn moved_up(turn: u64, left: u64, floor: u64) -> Option<u64> {
    (turn > left && turn > floor).then(|| turn - 1)
}

/// Whether the waiter `(turn, place)` goes before the waiter `(turn, place)` `other`.
pub fn goes_first(one: (u64, u64), other: (u64, u64)) -> bool {
    one < other
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A role's line: (tenant, turn, place). Waiters join with `join`, and each freed
    /// slot goes to the first in line (`serve`).
    #[derive(Default)]
    struct Line {
        waiting: Vec<(char, u64, u64)>,
        places: u64,
        /// (place, the front when it joined).
        floors: Vec<(u64, u64)>,
    }

    impl Line {
        fn join(&mut self, tenant: char) {
            let first = self.waiting.iter().map(|w| w.1).min();
            let last = self
                .waiting
                .iter()
                .filter(|w| w.0 == tenant)
                .map(|w| w.1)
                .max();
            self.places += 1;
            let turn = next_turn(front(first, None), last);
            self.floors.push((self.places, first.unwrap_or(0)));
            self.waiting.push((tenant, turn, self.places));
        }

        fn floor(&self, place: u64) -> u64 {
            self.floors.iter().find(|f| f.0 == place).unwrap().1
        }

        fn give_up(&mut self, place: u64) {
            let i = self.waiting.iter().position(|w| w.2 == place).unwrap();
            let (tenant, left, _) = self.waiting.remove(i);
            let floors: Vec<u64> = self.waiting.iter().map(|w| self.floor(w.2)).collect();
            for (w, floor) in self.waiting.iter_mut().zip(floors) {
                if w.0 == tenant {
                    if let Some(t) = moved_up(w.1, left, floor) {
                        w.1 = t;
                    }
                }
            }
        }

        fn serve(&mut self) -> char {
            let i = (0..self.waiting.len())
                .find(|&i| {
                    let w = self.waiting[i];
                    self.waiting
                        .iter()
                        .all(|o| o.2 == w.2 || !goes_first((o.1, o.2), (w.1, w.2)))
                })
                .expect("someone waits");
            self.waiting.remove(i).0
        }
    }

    #[test]
    fn a_tenant_with_one_start_is_not_behind_another_tenants_thousand() {
        let mut line = Line::default();
        for _ in 0..1000 {
            line.join('a');
        }
        line.join('b');
        // b's one start gets the second slot, not the 1,001st (arrival order).
        assert_eq!(line.serve(), 'a');
        assert_eq!(line.serve(), 'b');
        assert!((0..999).all(|_| line.serve() == 'a'));
    }

    #[test]
    fn one_waiting_start_is_admitted_within_as_many_slots_as_tenants_wait() {
        // Tenants a to e queue 50, 40, 30, 20 and 10 starts, in that order, then f one.
        let mut line = Line::default();
        for (t, n) in [('a', 50), ('b', 40), ('c', 30), ('d', 20), ('e', 10)] {
            for _ in 0..n {
                line.join(t);
            }
        }
        line.join('f');
        let order: Vec<char> = (0..151).map(|_| line.serve()).collect();
        let f = order.iter().position(|&t| t == 'f').unwrap();
        assert!(f < 6, "f served at slot {}: {order:?}", f + 1);
        // Then the others in turns: every tenant that still waits gets one of each
        // six consecutive slots... until it has none left.
        assert_eq!(&order[..6], &['a', 'b', 'c', 'd', 'e', 'f']);
        assert_eq!(&order[6..11], &['a', 'b', 'c', 'd', 'e']);
    }

    #[test]
    fn turns_given_up_are_not_kept_from_the_tenant() {
        // a and b queue 1,000 each, in turns; then a's first 999 give up.
        let mut line = Line::default();
        for _ in 0..1000 {
            line.join('a');
        }
        for _ in 0..1000 {
            line.join('b');
        }
        for place in 1..=999 {
            line.give_up(place);
        }
        // a's last waiter is now at the front turn: it goes within two slots.
        let order: Vec<char> = (0..3).map(|_| line.serve()).collect();
        assert!(order[..2].contains(&'a'), "{order:?}");
        assert_eq!(moved_up(5, 3, 0), Some(4));
        assert_eq!(moved_up(3, 3, 0), None);
        assert_eq!(moved_up(2, 3, 0), None);
        // Never before the front it joined at.
        assert_eq!(moved_up(200, 99, 200), None);
        assert_eq!(front(None, Some(10_000)), Some(10_000));
        assert_eq!(front(Some(7), Some(3)), Some(7));
        assert_eq!(front(None, None), None);
    }

    #[test]
    fn within_a_tenant_arrival_order_stays() {
        let mut line = Line::default();
        for t in ['a', 'b', 'a', 'c', 'a', 'b'] {
            line.join(t);
        }
        let mut seen = Vec::new();
        while !line.waiting.is_empty() {
            let first = line
                .waiting
                .iter()
                .copied()
                .min_by_key(|w| (w.1, w.2))
                .unwrap();
            assert_eq!(line.serve(), first.0);
            seen.push(first.2);
        }
        // a's places 1, 3, 5 in that order; b's 2, 6.
        let of = |places: &[u64]| {
            seen.iter()
                .filter(|p| places.contains(p))
                .copied()
                .collect::<Vec<_>>()
        };
        assert_eq!(of(&[1, 3, 5]), vec![1, 3, 5]);
        assert_eq!(of(&[2, 6]), vec![2, 6]);
    }

    #[test]
    fn a_tenant_arriving_later_joins_at_the_front_turn() {
        let mut line = Line::default();
        for _ in 0..3 {
            line.join('a');
        }
        assert_eq!(line.serve(), 'a');
        assert_eq!(line.serve(), 'a');
        // a's third start is now at the front (turn 2); b comes right after it.
        line.join('b');
        line.join('b');
        assert_eq!(line.serve(), 'a');
        assert_eq!(line.serve(), 'b');
        assert_eq!(line.serve(), 'b');
        assert_eq!(next_turn(None, None), 0);
        assert_eq!(next_turn(Some(7), None), 7);
        assert_eq!(next_turn(Some(7), Some(9)), 10);
        assert_eq!(next_turn(Some(7), Some(3)), 7);
    }
}
