//! Loading and validating a plugin library.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use specd_plugin_abi as abi;

use crate::error::{Result, SpecdError};

/// A validated, loaded plugin library.
#[derive(Debug)]
pub struct PluginLibrary {
    pub path: PathBuf,
    pub name: String,
    pub version: String,
    pub build_id: String,
    pub abi_minor: u32,
    /// The file `path` held when this was loaded.
    file: Option<FileId>,
    pub(super) caps: abi::Capabilities,
    pub(super) fns: Fns,
}

/// The plugin's functions, every one present (checked at load).
#[derive(Debug, Clone, Copy)]
pub(super) struct Fns {
    pub create: unsafe extern "C" fn(
        abi::Str,
        *const abi::HostApi,
        *mut abi::Instance,
        *mut u8,
        usize,
        *mut usize,
    ) -> abi::Status,
    pub destroy: unsafe extern "C" fn(abi::Instance),
    pub capabilities: unsafe extern "C" fn(abi::Instance, *mut abi::Capabilities) -> abi::Status,
    pub start: unsafe extern "C" fn(abi::Instance, u64, *const u32, usize) -> abi::Status,
    pub propose: unsafe extern "C" fn(
        abi::Instance,
        *const *const abi::SeqInput,
        usize,
        *mut abi::DraftOut,
    ) -> abi::Status,
    pub observe: unsafe extern "C" fn(abi::Instance, *const abi::ObserveInput) -> abi::Status,
    pub finish: unsafe extern "C" fn(abi::Instance, u64) -> abi::Status,
    pub last_error: unsafe extern "C" fn(abi::Instance, *mut u8, usize) -> usize,
}

impl Fns {
    fn from_abi(v: &abi::VTable) -> std::result::Result<Self, String> {
        let missing = |f: &str| format!("the vtable has no `{f}` function");
        Ok(Self {
            create: v.create.ok_or_else(|| missing("create"))?,
            destroy: v.destroy.ok_or_else(|| missing("destroy"))?,
            capabilities: v.capabilities.ok_or_else(|| missing("capabilities"))?,
            start: v.start.ok_or_else(|| missing("start"))?,
            propose: v.propose.ok_or_else(|| missing("propose"))?,
            observe: v.observe.ok_or_else(|| missing("observe"))?,
            finish: v.finish.ok_or_else(|| missing("finish"))?,
            last_error: v.last_error.ok_or_else(|| missing("last_error"))?,
        })
    }
}

fn plugin_err(path: &Path, why: impl std::fmt::Display) -> SpecdError {
    SpecdError::Plugin(format!("{}: {why}", path.display()))
}

/// # Safety
/// `s` must point to `len` bytes valid for the life of the library.
pub(super) unsafe fn abi_string(s: abi::Str) -> String {
    if s.ptr.is_null() || s.len == 0 {
        return String::new();
    }
    // SAFETY: guaranteed by the caller (descriptor strings are static).
    let bytes = unsafe { std::slice::from_raw_parts(s.ptr, s.len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// Which file a path held when it was loaded: a library rebuilt in its
/// place (a new file renamed over it) has another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileId {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

pub(super) fn file_id(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(FileId {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    })
}

type Registry = HashMap<PathBuf, (Option<FileId>, Arc<PluginLibrary>)>;

fn registry() -> &'static Mutex<Registry> {
    static LIBS: OnceLock<Mutex<Registry>> = OnceLock::new();
    LIBS.get_or_init(|| Mutex::new(HashMap::new()))
}

impl PluginLibrary {
    /// Whether the file at `path` was replaced since this library was
    /// loaded from it (a rebuilt plugin; `load_library` loads the new one).
    pub fn rebuilt(&self) -> bool {
        file_id(&self.path) != self.file
    }
}

/// A private copy of `path` to load a rebuilt library from: the dynamic
/// loader hands back the library already loaded under a name, so the new
/// file needs another. Unlinked once loaded (the mapping stays).
fn fresh_copy(path: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!("specd-{}-plugins", std::process::id()));
    private_dir(&dir)?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let copy = dir.join(format!("{}-{name}", N.fetch_add(1, Ordering::Relaxed)));
    // A new file (never one planted there, nor a link's target), which
    // only this user may read or replace before it is loaded.
    let mut to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o700)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&copy)?;
    std::io::copy(&mut std::fs::File::open(path)?, &mut to)?;
    Ok(copy)
}

/// Create `dir` (mode 0700), or accept it where it exists only if it is a
/// real directory this user owns that nobody else may enter: its path is
/// predictable (the process id), so another local user could have made it
/// first, or put a link there, to have the daemon load or write their
/// files.
pub(super) fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let m = std::fs::symlink_metadata(dir)?;
            // SAFETY: geteuid has no preconditions and cannot fail.
            let me = unsafe { libc::geteuid() };
            if !m.is_dir() || m.permissions().mode() & 0o077 != 0 || m.uid() != me {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "{} exists and is not a private directory of this user",
                        dir.display()
                    ),
                ));
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Load and validate the plugin library at `path` (once per process and
/// file: a library rebuilt at the same path is loaded anew; the old one
/// stays mapped for the instances still using it).
pub fn load_library(path: &Path) -> Result<Arc<PluginLibrary>> {
    let canon = path
        .canonicalize()
        .map_err(|e| plugin_err(path, format!("cannot open: {e}")))?;
    let id = file_id(&canon);
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    let open = match reg.get(&canon) {
        Some((was, l)) if *was == id => return Ok(l.clone()),
        Some(_) => fresh_copy(&canon)
            .map_err(|e| plugin_err(path, format!("cannot copy the rebuilt library: {e}")))?,
        None => canon.clone(),
    };
    // SAFETY: loading a library runs its initialisers. We only load files
    // the operator configured as specd plugins; that trust is the contract
    // of a plugin system. Errors (not a library, wrong architecture) come
    // back as `Err` without running anything.
    let lib = unsafe { libloading::Library::new(&open) }
        .map_err(|e| plugin_err(path, format!("not a loadable library: {e}")));
    if open != canon {
        let _ = std::fs::remove_file(&open);
        if let Some(dir) = open.parent() {
            // Loads run one at a time (the registry lock): it is empty.
            let _ = std::fs::remove_dir(dir);
        }
    }
    let lib = lib?;
    // SAFETY: the symbol is looked up by name; its type is fixed by the ABI.
    let entry: libloading::Symbol<'_, abi::EntryFn> = unsafe { lib.get(abi::ENTRY_SYMBOL) }.map_err(|_| {
        plugin_err(
            path,
            "missing entry symbol `specd_proposer_entry`: not a specd proposer plugin (build it with specd-plugin-sdk's export_proposer!)",
        )
    })?;
    // SAFETY: calling the plugin's entry function, which the ABI defines as
    // returning a pointer to a static descriptor (or null).
    let desc_ptr = unsafe { entry() };
    if desc_ptr.is_null() {
        return Err(plugin_err(path, "entry symbol returned no descriptor"));
    }
    // Read the versions first: their offsets never change.
    // SAFETY: every descriptor starts with abi_major, abi_minor, struct_size.
    let (major, minor, size) = unsafe {
        let p = desc_ptr as *const u32;
        (
            p.read_unaligned(),
            p.add(1).read_unaligned(),
            p.add(2).read_unaligned(),
        )
    };
    if major != abi::ABI_MAJOR {
        return Err(plugin_err(
            path,
            format!(
                "ABI mismatch: plugin built for ABI {major}.{minor}, this host speaks ABI {}.{}",
                abi::ABI_MAJOR,
                abi::ABI_MINOR
            ),
        ));
    }
    let known = std::mem::size_of::<abi::Descriptor>();
    if (size as usize) < known {
        return Err(plugin_err(
            path,
            format!("descriptor of {size} bytes is smaller than ABI {major}.0's {known}"),
        ));
    }
    // SAFETY: the plugin declares at least `known` readable bytes (checked
    // above); we copy exactly our struct's size, ignoring appended fields.
    let desc: abi::Descriptor = unsafe { std::ptr::read_unaligned(desc_ptr) };
    // SAFETY: the descriptor's pointers refer to static, size-prefixed
    // structs of the library (or are null, which `read_sized` refuses).
    let (caps, vtable) = unsafe { (abi::read_sized(desc.caps), abi::read_sized(desc.vtable)) };
    let caps = caps.ok_or_else(|| plugin_err(path, "descriptor has no capabilities"))?;
    let vtable = vtable.ok_or_else(|| plugin_err(path, "descriptor has no vtable"))?;
    let fns = Fns::from_abi(&vtable).map_err(|e| plugin_err(path, e))?;
    // SAFETY: descriptor strings are static in the library, never unloaded.
    let (name, version, build_id) = unsafe {
        (
            abi_string(desc.name),
            abi_string(desc.version),
            abi_string(desc.build_id),
        )
    };
    if name.is_empty() {
        return Err(plugin_err(path, "descriptor has an empty name"));
    }
    let loaded = Arc::new(PluginLibrary {
        path: canon.clone(),
        name,
        version,
        build_id,
        abi_minor: minor,
        file: id,
        caps,
        fns,
    });
    // Never unload: instances and their callbacks may outlive any owner.
    std::mem::forget(lib);
    reg.insert(canon, (id, loaded.clone()));
    tracing::info!(plugin = %loaded.name, version = %loaded.version, build = %loaded.build_id, path = %path.display(), "loaded proposer plugin");
    Ok(loaded)
}

#[cfg(test)]
mod tests {
    use super::private_dir;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_private_dir_is_made_or_accepted_only_if_private_and_real() {
        let base = std::env::temp_dir().join(format!("specd-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        // Made: mode 0700; made again: accepted.
        let d = base.join("new");
        private_dir(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        private_dir(&d).unwrap();
        // Another user could enter (or have made) a group/world-open one.
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = private_dir(&open).unwrap_err();
        assert!(e.to_string().contains("not a private directory"), "{e}");
        // A link planted at the path, even to a private directory.
        let link = base.join("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        assert!(private_dir(&link).is_err());
        // A file at the path.
        let file = base.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(private_dir(&file).is_err());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
