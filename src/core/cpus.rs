//! Sets of CPUs a thread may run on (its affinity), written as Linux writes them in
//! `/proc/*/status` and `taskset -c` reads them: `0-3,6`. A pool's worker given CPUs of its own
//! stops sharing a core's caches (and, for a worker process, its address space switches) with
//! the HTTP side: see `docs/isolation.md`.

use std::collections::BTreeSet;
use std::fmt;

/// Highest CPU number accepted: the kernel's `cpu_set_t` holds 1024.
const MOST: usize = 1024;

/// A non-empty set of CPU numbers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CpuSet(BTreeSet<usize>);

impl CpuSet {
    /// Parse a CPU list: numbers and inclusive ranges separated by commas (`0-3,6`).
    pub fn parse(text: &str) -> Result<CpuSet, String> {
        let mut cpus = BTreeSet::new();
        for part in text.split(',').map(str::trim) {
            let number = |s: &str| -> Result<usize, String> {
                let n: usize = s
                    .trim()
                    .parse()
                    .map_err(|_| format!("`{s}` in `{text}` is not a CPU number; expected a list such as `0-3,6`"))?;
                if n >= MOST {
                    return Err(format!("CPU {n} in `{text}` is beyond the highest, {}", MOST - 1));
                }
                Ok(n)
            };
            match part.split_once('-') {
                Some((first, last)) => {
                    let (first, last) = (number(first)?, number(last)?);
                    if first > last {
                        return Err(format!("the range `{part}` in `{text}` runs backwards"));
                    }
                    cpus.extend(first..=last);
                }
                None => {
                    cpus.insert(number(part)?);
                }
            }
        }
        CpuSet::new(cpus).ok_or_else(|| format!("`{text}` names no CPU"))
    }

    /// The set of `cpus`, `None` when empty.
    pub fn new(cpus: impl IntoIterator<Item = usize>) -> Option<CpuSet> {
        let cpus: BTreeSet<usize> = cpus.into_iter().collect();
        (!cpus.is_empty() && cpus.iter().all(|&c| c < MOST)).then_some(CpuSet(cpus))
    }

    /// How many CPUs it holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never: a set holds at least one CPU.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Its CPU numbers, lowest first.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().copied()
    }

    /// Its CPUs that are not in `other`, if any.
    pub fn outside(&self, other: &CpuSet) -> Option<CpuSet> {
        CpuSet::new(self.0.difference(&other.0).copied())
    }

    /// The CPUs the calling thread may run on now.
    #[allow(unsafe_code)]
    pub fn current() -> Result<CpuSet, String> {
        // SAFETY: an all-zero cpu_set_t is a valid empty set; sched_getaffinity writes at most
        // `size_of::<cpu_set_t>()` bytes into it, and CPU_ISSET reads within it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Err(format!(
                    "cannot read this thread's CPUs: {}",
                    std::io::Error::last_os_error()
                ));
            }
            CpuSet::new((0..MOST).filter(|&c| libc::CPU_ISSET(c, &set)))
                .ok_or_else(|| "this thread may run on no CPU".to_string())
        }
    }

    /// Let the calling thread (and the threads it starts from now on, which inherit it) run only
    /// on these CPUs.
    #[allow(unsafe_code)]
    pub fn apply_to_this_thread(&self) -> Result<(), String> {
        // SAFETY: as in `current`; CPU_SET writes only bits below MOST, within the set.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for cpu in self.iter() {
                libc::CPU_SET(cpu, &mut set);
            }
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(format!(
                    "cannot run on CPUs {self}: {}",
                    std::io::Error::last_os_error()
                ));
            }
        }
        Ok(())
    }

    /// Run `f` with the calling thread on these CPUs, then put it back where it was: threads `f`
    /// starts (ONNX Runtime's intra-op threads, when it builds a session) keep these CPUs.
    pub fn while_applied<T>(&self, f: impl FnOnce() -> T) -> Result<T, String> {
        let before = CpuSet::current()?;
        self.apply_to_this_thread()?;
        let out = f();
        before.apply_to_this_thread()?;
        Ok(out)
    }
}

/// `0-3,6`: ranges for runs of three or more, as the kernel writes them.
impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for cpu in self.iter() {
            match runs.last_mut() {
                Some((_, last)) if *last + 1 == cpu => *last = cpu,
                _ => runs.push((cpu, cpu)),
            }
        }
        let mut first = true;
        for (start, end) in runs {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            match end - start {
                0 => write!(f, "{start}")?,
                1 => write!(f, "{start},{end}")?,
                _ => write!(f, "{start}-{end}")?,
            }
        }
        Ok(())
    }
}

impl serde::Serialize for CpuSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for CpuSet {
    /// As a configuration writes it: see [`CpuList`].
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        CpuList::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// A CPU list as a configuration writes it, not yet checked: text (`"0-3,6"`), one CPU
/// number, or a list of numbers. Validation turns it into a [`CpuSet`] with the key named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuList(String);

impl CpuList {
    /// The set it names.
    pub fn parse(&self) -> Result<CpuSet, String> {
        CpuSet::parse(&self.0)
    }
}

impl serde::Serialize for CpuList {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for CpuList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = CpuList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a CPU list such as `0-3,6`, a CPU number, or a list of numbers")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<CpuList, E> {
                Ok(CpuList(n.to_string()))
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<CpuList, E> {
                Ok(CpuList(text.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<CpuList, A::Error> {
                let mut numbers = Vec::new();
                while let Some(n) = seq.next_element::<u64>()? {
                    numbers.push(n.to_string());
                }
                Ok(CpuList(numbers.join(",")))
            }
        }
        d.deserialize_any(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_print_as_the_kernel_writes_them() {
        let set = CpuSet::parse("6, 0-3,2").unwrap();
        assert_eq!(set.iter().collect::<Vec<_>>(), [0, 1, 2, 3, 6]);
        assert_eq!(set.to_string(), "0-3,6");
        assert_eq!(CpuSet::parse("4,5").unwrap().to_string(), "4,5");
        assert_eq!(CpuSet::parse("7").unwrap().len(), 1);
        let outside = CpuSet::parse("0-3").unwrap().outside(&CpuSet::parse("1,2").unwrap());
        assert_eq!(outside.map(|s| s.to_string()).as_deref(), Some("0,3"));
        assert_eq!(CpuSet::parse("1").unwrap().outside(&set), None);
    }

    #[test]
    fn bad_lists_are_refused_naming_what_is_wrong() {
        for (text, says) in [
            ("", "not a CPU number"),
            ("1,x", "`x`"),
            ("3-1", "runs backwards"),
            ("5000", "beyond the highest"),
            ("-1", "not a CPU number"),
        ] {
            let err = CpuSet::parse(text).unwrap_err();
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn configs_give_text_a_number_or_a_list() {
        let read = |y: &str| serde_json::from_str::<CpuSet>(y).map(|s| s.to_string());
        assert_eq!(
            serde_json::from_str::<CpuList>("[3, 1]")
                .unwrap()
                .parse()
                .unwrap()
                .to_string(),
            "1,3"
        );
        assert_eq!(read("\"0-2\"").unwrap(), "0-2");
        assert_eq!(read("1").unwrap(), "1");
        assert_eq!(read("[3, 1]").unwrap(), "1,3");
        assert!(read("{\"a\": 1}").unwrap_err().to_string().contains("CPU list"));
        assert!(read("\"2-1\"").unwrap_err().to_string().contains("runs backwards"));
    }

    #[test]
    fn a_thread_runs_where_it_is_put_and_goes_back() {
        // Its own thread: the test harness's threads keep their CPUs.
        std::thread::spawn(|| {
            let all = CpuSet::current().unwrap();
            let first = CpuSet::new(all.iter().take(1)).unwrap();
            let inside = first
                .while_applied(|| {
                    let started = std::thread::spawn(|| CpuSet::current().unwrap()).join().unwrap();
                    (CpuSet::current().unwrap(), started)
                })
                .unwrap();
            assert_eq!(inside, (first.clone(), first));
            assert_eq!(CpuSet::current().unwrap(), all);
        })
        .join()
        .unwrap();
    }
}
