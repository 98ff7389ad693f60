//! Where a scope's counter goes in the scope counter table (src/scopes.rs), a hash
//! table with open addressing. A scope lives within `WINDOW` entries of its home
//! entry, so that finding it, or finding that it is missing, never walks more than
//! that, however full the table and however many entries were removed. When the
//! window has no room, the least recently used counter in it gives its entry up: a
//! counter is only a cache of the ledger, rebuilt from it when needed again.

/// How many entries from its home a scope may live: a lookup reads at most this many.
pub const WINDOW: usize = 64;

/// What one entry of a scope's window holds, as the placement sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Never used: nothing lives past it in this window.
    Free,
    /// A removed scope's entry (dropped role or database).
    Removed,
    /// Another scope's counter; `valid` is false when it is to be rebuilt anyway;
    /// `used` is when it was last read (seconds, larger is later).
    Taken { valid: bool, used: u32 },
}

/// The offset within the window where a new scope goes: the first free or removed
/// entry; else the first counter that is stale; else the least recently used one (the
/// first of equals). None only for an empty window.
pub fn place(window: impl IntoIterator<Item = Entry>) -> Option<usize> {
    let mut stale = None;
    let mut oldest: Option<(u32, usize)> = None;
    for (k, e) in window.into_iter().enumerate() {
        match e {
            Entry::Free | Entry::Removed => return Some(k),
            Entry::Taken { valid: false, .. } => {
                stale.get_or_insert(k);
            }
            Entry::Taken { valid: true, used } => {
                if oldest.is_none_or(|(u, _)| used < u) {
                    oldest = Some((used, k));
                }
            }
        }
    }
    stale.or(oldest.map(|(_, k)| k))
}

/// The window of a table of `n` entries: WINDOW, or the whole table if smaller.
pub fn window(n: usize) -> usize {
    WINDOW.min(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Entry::*;

    fn taken(used: u32) -> Entry {
        Taken { valid: true, used }
    }

    #[test]
    fn the_first_free_or_removed_entry_is_taken() {
        assert_eq!(place([taken(1), Removed, Free]), Some(1));
        assert_eq!(place([taken(1), taken(2), Free, Removed]), Some(2));
        assert_eq!(place([Free]), Some(0));
    }

    #[test]
    fn a_full_window_gives_up_a_stale_counter_first() {
        let w = [
            taken(1),
            Taken {
                valid: false,
                used: 9,
            },
            taken(0),
            Taken {
                valid: false,
                used: 0,
            },
        ];
        assert_eq!(place(w), Some(1));
    }

    #[test]
    fn else_the_least_recently_used_one() {
        assert_eq!(place([taken(5), taken(3), taken(7), taken(3)]), Some(1));
        assert_eq!(place([taken(4)]), Some(0));
    }

    #[test]
    fn an_empty_window_has_no_place() {
        assert_eq!(place([]), None);
    }

    #[test]
    fn the_window_never_passes_the_table() {
        assert_eq!(window(16), 16);
        assert_eq!(window(1 << 20), WINDOW);
    }
}
