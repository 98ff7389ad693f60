//! Where a scope's counter goes in the scope counter table (src/scopes.rs), a hash
//! table with open addressing. A scope lives within `WINDOW` entries of its home
//! entry, so that finding it, or finding that it is missing, never walks more than
//! that, however full the table and however many entries were removed. When the
//! window has no room, the least recently used counter in it gives its entry up: a
//! counter is only a cache of the ledger, rebuilt from it when needed again. A counter
//! read in the last `MIN_IDLE_SECS` is never given up: when the scopes in use at once
//! outnumber the counters, the newcomer goes without one (and is counted from the
//! ledger, outside the counters' lock) rather than every miss rebuilding a counter
//! under that lock, which every admission of the server waits for.
//!
//! From 0.5.0 a scope is a role or a tenant of a role, and a counter can be pinned: it
//! holds the scope's uncommitted transactional charges, which exist nowhere else, so it
//! never gives its entry up while it holds any.

/// How many entries from its home a scope may live: a lookup reads at most this many.
pub const WINDOW: usize = 64;

/// A counter read this recently (seconds) keeps its entry.
pub const MIN_IDLE_SECS: u32 = 2;

/// What one entry of a scope's window holds, as the placement sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Never used: nothing lives past it in this window.
    Free,
    /// A removed scope's entry (dropped role or database).
    Removed,
    /// Another scope's counter; `valid` is false when it is to be rebuilt anyway;
    /// `used` is when it was last read (seconds, larger is later); `pinned` while it
    /// holds uncommitted transactional charges (never given up then).
    Taken {
        valid: bool,
        used: u32,
        pinned: bool,
    },
}

/// The offset within the window where a new scope goes at time `now`: the first free
/// or removed entry; else the first counter that is stale; else the least recently
/// used one (the first of equals), unless it was read within MIN_IDLE_SECS of `now`.
/// None if there is none of those.
pub fn place(window: impl IntoIterator<Item = Entry>, now: u32) -> Option<usize> {
    place_where(window, now, MIN_IDLE_SECS)
}

/// Where a scope that must have a counter goes (one taking a transactional charge,
/// which only a counter can hold): as `place`, but a counter read lately gives its
/// entry up too; only pinned counters never do. None if every counter of the window
/// is pinned.
pub fn place_pinned(window: impl IntoIterator<Item = Entry>, now: u32) -> Option<usize> {
    place_where(window, now, 0)
}

fn place_where(window: impl IntoIterator<Item = Entry>, now: u32, min_idle: u32) -> Option<usize> {
    let mut stale = None;
    let mut oldest: Option<(u32, usize)> = None;
    for (k, e) in window.into_iter().enumerate() {
        match e {
            Entry::Free | Entry::Removed => return Some(k),
            Entry::Taken { pinned: true, .. } => {}
            Entry::Taken { valid: false, .. } => {
                stale.get_or_insert(k);
            }
            Entry::Taken {
                valid: true, used, ..
            } => {
                // A `used` far in the future (the clock stepped back) is idle too.
                if used.abs_diff(now) >= min_idle && oldest.is_none_or(|(u, _)| used < u) {
                    oldest = Some((used, k));
                }
            }
        }
    }
    stale.or(oldest.map(|(_, k)| k))
}

/// What an entry holds, as a lookup sees it. Whether an entry is free, taken or removed
/// is state of its own, apart from the key: 0.4.0 marked a removed entry with the
/// database OID 4294967295, which a database can have, and that database's scopes
/// then found other databases' removed counters as their own (see `find`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Free,
    Removed,
    /// The counter of scope (database, role, tenant); tenant 0 is the role itself.
    Taken(u32, u32, u128),
}

/// The offset within the window of the counter of (`db`, `role`): probing stops at the
/// first free entry (nothing was ever placed past it) and goes on past removed ones,
/// whatever key they had.
pub fn find(
    window: impl IntoIterator<Item = Slot>,
    db: u32,
    role: u32,
    tenant: u128,
) -> Option<usize> {
    for (k, s) in window.into_iter().enumerate() {
        match s {
            Slot::Free => return None,
            Slot::Taken(d, r, t) if d == db && r == role && t == tenant => return Some(k),
            Slot::Taken(..) | Slot::Removed => {}
        }
    }
    None
}

/// How placement judges another scope's counter in the window: one of the caller's own
/// database by whether it is `current` for that database's relations, one of another
/// database, whose relations the caller cannot see, by its own `valid` flag. Both by
/// when it was `used`. (0.4.0 judged every counter by the caller's relations, so the
/// counters of other databases always looked stale and were given up first, even if
/// read a moment ago.)
pub fn judged(same_db: bool, valid: bool, current: bool, used: u32, pinned: bool) -> Entry {
    Entry::Taken {
        valid: if same_db { current } else { valid },
        used,
        pinned,
    }
}

/// The window of a table of `n` entries: WINDOW, or the whole table if smaller.
pub fn window(n: usize) -> usize {
    WINDOW.min(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Entry::*;

    const NOW: u32 = 100;

    fn taken(used: u32) -> Entry {
        Taken {
            valid: true,
            used,
            pinned: false,
        }
    }

    #[test]
    fn the_first_free_or_removed_entry_is_taken() {
        assert_eq!(place([taken(NOW), Removed, Free], NOW), Some(1));
        assert_eq!(place([taken(NOW), taken(1), Free, Removed], NOW), Some(2));
        assert_eq!(place([Free], NOW), Some(0));
    }

    #[test]
    fn a_full_window_gives_up_a_stale_counter_first() {
        let w = [
            taken(1),
            Taken {
                valid: false,
                used: NOW,
                pinned: false,
            },
            taken(0),
            Taken {
                valid: false,
                used: 0,
                pinned: false,
            },
        ];
        assert_eq!(place(w, NOW), Some(1));
    }

    #[test]
    fn else_the_least_recently_used_one() {
        assert_eq!(
            place([taken(5), taken(3), taken(7), taken(3)], NOW),
            Some(1)
        );
        assert_eq!(place([taken(4)], NOW), Some(0));
    }

    #[test]
    fn a_counter_read_lately_keeps_its_entry() {
        let lately = NOW - MIN_IDLE_SECS + 1;
        assert_eq!(place([taken(NOW), taken(lately)], NOW), None);
        assert_eq!(
            place([taken(NOW), taken(NOW - MIN_IDLE_SECS)], NOW),
            Some(1)
        );
        // Read "in the future": just now on another backend's clock, or before the
        // clock stepped back; only the first keeps its place.
        assert_eq!(place([taken(NOW + 1)], NOW), None);
        assert_eq!(place([taken(NOW + 5)], NOW), Some(0));
    }

    #[test]
    fn an_empty_window_has_no_place() {
        assert_eq!(place([], NOW), None);
    }

    #[test]
    fn find_stops_at_a_free_entry_and_passes_removed_ones() {
        use Slot::*;
        let w = [
            Taken(1, 5, 0),
            Removed,
            Taken(2, 5, 0),
            Free,
            Taken(2, 6, 0),
        ];
        assert_eq!(find(w, 1, 5, 0), Some(0));
        assert_eq!(find(w, 2, 5, 0), Some(2));
        assert_eq!(find(w, 2, 6, 0), None);
        assert_eq!(find(w, 3, 5, 0), None);
        // A tenant's counter is its own, apart from its role's.
        let w = [Taken(1, 5, 0), Taken(1, 5, 77), Free];
        assert_eq!(find(w, 1, 5, 77), Some(1));
        assert_eq!(find(w, 1, 5, 78), None);
    }

    /// F5: a removed entry matches no scope, whatever database OID it had, the largest
    /// one (0.4.0's mark for "removed") included; the scope's real counter behind it is
    /// found instead.
    #[test]
    fn a_removed_entry_is_nobodys_counter() {
        use Slot::*;
        let max = u32::MAX;
        assert_eq!(find([Removed, Taken(max, 7, 0)], max, 7, 0), Some(1));
        assert_eq!(find([Removed, Removed, Free], max, 7, 0), None);
    }

    /// F2: another database's counter read lately keeps its place, though it is not
    /// current for the caller's relations; one of the caller's database that is not
    /// current is stale.
    #[test]
    fn other_databases_counters_are_judged_by_their_use() {
        let theirs = judged(false, true, false, NOW, false);
        assert_eq!(place([theirs], NOW), None);
        assert_eq!(
            place([judged(false, true, false, NOW - 5, false)], NOW),
            Some(0)
        );
        assert_eq!(
            place(
                [
                    judged(true, true, false, NOW, false),
                    judged(false, false, false, NOW, false)
                ],
                NOW
            ),
            Some(0)
        );
    }

    /// 0.5.0: a pinned counter (holding transactional charges) never gives its entry
    /// up; a scope that must have a counter takes one read lately if it must.
    #[test]
    fn pinned_counters_keep_their_entries() {
        let pinned = |used| Taken {
            valid: false,
            used,
            pinned: true,
        };
        assert_eq!(place([pinned(0), taken(NOW)], NOW), None);
        assert_eq!(place_pinned([pinned(0), taken(NOW)], NOW), Some(1));
        assert_eq!(place_pinned([pinned(0), pinned(NOW)], NOW), None);
        assert_eq!(place_pinned([pinned(0), Removed], NOW), Some(1));
    }

    #[test]
    fn the_window_never_passes_the_table() {
        assert_eq!(window(16), 16);
        assert_eq!(window(1 << 20), WINDOW);
    }
}
