//! [`Few`]: one value inline, more on the heap.

/// One value inline, more on the heap: most blocks have one engine hash and
/// most keys one holder, and a `Vec` each would cost an allocation per block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Few<T> {
    /// One value.
    One(T),
    /// Two or more.
    Many(Vec<T>),
}

impl<T: Copy + PartialEq> Few<T> {
    pub(super) fn as_slice(&self) -> &[T] {
        match self {
            Few::One(x) => std::slice::from_ref(x),
            Few::Many(v) => v,
        }
    }

    pub(super) fn push(&mut self, x: T) {
        match self {
            Few::One(y) => *self = Few::Many(vec![*y, x]),
            Few::Many(v) => v.push(x),
        }
    }

    /// Removes `x`; true when nothing is left.
    pub(super) fn remove(&mut self, x: T) -> bool {
        match self {
            Few::One(y) => *y == x,
            Few::Many(v) => {
                v.retain(|y| *y != x);
                match v.as_slice() {
                    [] => true,
                    [one] => {
                        *self = Few::One(*one);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}
